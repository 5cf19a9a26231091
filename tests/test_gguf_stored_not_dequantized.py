"""On ``device="cpu"`` the GGUF tensors the CPU path takes as the file's blocks (a K-quant or Q8_0 lm_head:
``GGUFLinear``; Q4_0 / Q4_1 attention: the CPU int4 layers of ``engine/gguf_linears.py``; gpt-oss's Q8_0 attention)
are never dequantized at load (issue 37, 42): a spy on the reader's dequantizer sees every other tensor and none of
those, and the model gives the greedy tokens of a load that dequantizes them first (the path before the change).
~25 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_models import T, random_k_experts, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

import moeflow.engine.build as build  # noqa: E402
import moeflow.engine.gguf_linears as gguf_linears  # noqa: E402
import moeflow.io.gguf.reader as gguf_reader  # noqa: E402
from moeflow import MoEModel  # noqa: E402
from moeflow.kernels.cpu.gguf import GGUFLinear  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear  # noqa: E402

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
    """Q4_0 q / o, Q8_0 k / v (on the file's blocks: GGUFLinear) and a Q6_K lm_head taken as stored: not
    dequantized; the norms and the router: dequantized as before. Same tokens as dequantizing everything."""
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
    skipped = {"output.weight"} | {f"blk.{i}.attn_{p}.weight" for i in range(LAYERS) for p in ("q", "k", "v", "output")}
    assert not skipped & set(seen), sorted(skipped & set(seen))
    for i in range(LAYERS):  # the rest is read as before
        assert {f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_gate_inp.weight"} <= set(seen)

    # the path before: every non-expert tensor dequantized at load, then replaced by the same stored layers
    monkeypatch.setattr(build, "stored_weight_names", lambda *a, **k: frozenset())
    before, seen_before, head_before = _load_and_generate(path, ids, monkeypatch)
    assert skipped <= set(seen_before)  # (the spy sees them when they are dequantized)
    assert head_before is GGUFLinear
    assert torch.equal(out, before)


@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss"])
def test_a_q8_0_head_is_not_dequantized(tmp_path, monkeypatch, arch):
    """A Q8_0 output.weight (llama.cpp's Q8_0 files; gpt-oss's at every file type): GGUFLinear on the file's
    blocks, never dequantized; gpt-oss's Q8_0 attention neither. The path before (every non-expert tensor
    dequantized, the head then int8 of its values) dequantizes it; the file's blocks give the same greedy tokens
    here (the int8 head rounds the weights a second time: a model whose top logits are close could differ)."""
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    if arch == "mixtral":
        write_gguf(make_tiny_model(seed=5, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS), path,
                   expert_types=T.Q4_0, other_type=T.Q8_0)
        skipped = {"output.weight"}
    else:
        from gguf_gpt_oss import write_gpt_oss_gguf
        from gpt_oss_helpers import make_gpt_oss_model

        write_gpt_oss_gguf(make_gpt_oss_model(seed=12, num_hidden_layers=LAYERS, intermediate_size=96), path)
        skipped = {"output.weight"} | {f"blk.{i}.attn_{p}.weight" for i in range(LAYERS)
                                       for p in ("q", "k", "v", "output")}
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))

    out, seen, head_type = _load_and_generate(path, ids, monkeypatch)
    assert head_type is GGUFLinear
    assert not skipped & set(seen), sorted(skipped & set(seen))
    assert {"output_norm.weight", f"blk.{LAYERS - 1}.attn_norm.weight"} <= set(seen)  # the rest: read as before

    monkeypatch.setattr(build, "stored_weight_names", lambda *a, **k: frozenset())
    monkeypatch.setattr(gguf_linears, "LM_HEAD_TYPES", tuple(t for t in gguf_linears.LM_HEAD_TYPES if t != "Q8_0"))
    before, seen_before, head_before = _load_and_generate(path, ids, monkeypatch)
    assert "output.weight" in seen_before and head_before is CpuQuantLinear  # int8 of the dequantized values
    assert torch.equal(out, before)
