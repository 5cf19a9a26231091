"""On ``device="cpu"`` the GGUF tensors the CPU path takes as the file's blocks (a K-quant lm_head: ``GGUFLinear``;
Q4_0 / Q4_1 attention: the CPU int4 layers of ``engine/gguf_linears.py``) are never dequantized at load (issue 37):
a spy on the reader's dequantizer sees every other tensor and none of those, and the model gives the greedy tokens
of a load that dequantizes them first (the path before the change). ~15 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_models import T, random_k_experts, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

import moeflow.engine.build as build  # noqa: E402
import moeflow.io.gguf.reader as gguf_reader  # noqa: E402
from moeflow import MoEModel  # noqa: E402
from moeflow.kernels.cpu.gguf import GGUFLinear  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

H, I, LAYERS, NEW_TOKENS = 256, 256, 2, 5


def _load_and_generate(path, ids, monkeypatch) -> tuple[torch.Tensor, list[str], MoEModel]:
    seen: list[str] = []
    inner = gguf_reader.dequantize

    def spy(raw, type_id, what):
        seen.append(what.rsplit(": ", 1)[-1])  # "file: tensor name" -> the GGUF tensor name
        return inner(raw, type_id, what)
    monkeypatch.setattr(gguf_reader, "dequantize", spy)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu")
    try:
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        head = type(model.model.lm_head)
    finally:
        model.close()
    monkeypatch.setattr(gguf_reader, "dequantize", inner)
    return out, seen, head


def test_stored_tensors_are_not_dequantized(tmp_path, monkeypatch):
    """Q4_0 q / o and a Q6_K lm_head taken as stored: not dequantized; Q8_0 k / v (no int4 form: int8 of their
    values), the norms and the router: dequantized as before. Same tokens as dequantizing everything."""
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(seed=5, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS)
    head = random_k_experts("Q6_K", 1, model.config.vocab_size, 9, H)[0]
    path = tmp_path / "mixed.gguf"
    write_gguf(model, path, expert_types=T.Q4_0, other_type=T.Q4_0,
               types_by_suffix={"attn_k.weight": T.Q8_0, "attn_v.weight": T.Q8_0},
               raw_tensors={"output.weight": (head, T.Q6_K)})
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))

    out, seen, head_type = _load_and_generate(path, ids, monkeypatch)
    assert head_type is GGUFLinear
    skipped = {"output.weight"} | {f"blk.{i}.attn_{p}.weight" for i in range(LAYERS) for p in ("q", "output")}
    assert not skipped & set(seen), sorted(skipped & set(seen))
    for i in range(LAYERS):  # the rest is read as before
        assert {f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight", f"blk.{i}.attn_norm.weight"} <= set(seen)

    # the path before: every non-expert tensor dequantized at load, then replaced by the same stored layers
    monkeypatch.setattr(build, "stored_weight_names", lambda *a, **k: frozenset())
    before, seen_before, head_before = _load_and_generate(path, ids, monkeypatch)
    assert skipped <= set(seen_before)  # (the spy sees them when they are dequantized)
    assert head_before is GGUFLinear
    assert torch.equal(out, before)
