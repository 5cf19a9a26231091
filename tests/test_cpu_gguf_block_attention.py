"""A GGUF file's Q8_0 / Q5_K / Q6_K attention on ``device="cpu"`` computed on the file's blocks (issue 42:
``GGUFStoredLinears.cpu_linear`` -> ``GGUFLinear``, gguf.c's kernels; ``step.h``'s ``MF_LINEAR_GGUF`` in the
one-call step and the per-layer attention half), under ``attention_bits="auto"``: never dequantized at load, each
weight the file's value (q / k rows un-permuted as whole rows of blocks), k and v fused as one matrix of rows
(q beside them in another type: ``SplitLinear``); the one-call step's lm_head inputs the per-layer path's bit for
bit at 1, 2 and 3 threads; every offload policy the resident model's greedy tokens; ``attention_bits=4`` keeps the
path before (int4 of the dequantized values). Q4_K_M-like mix: q Q5_K, k / v Q6_K, o Q8_0. ~12 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_models import T, random_k_experts, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

import moeflow.engine.cpu_layers as cpu_layers  # noqa: E402
import moeflow.io.gguf.reader as gguf_reader  # noqa: E402
from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402
from moeflow.kernels.cpu.gguf import GGUFLinear  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, SplitLinear  # noqa: E402
from moeflow.quant.ggml import dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

H, LAYERS = 256, 2
TYPES = {"q": "Q5_K", "k": "Q6_K", "v": "Q6_K", "output": "Q8_0"}  # GGUF attn_<p>.weight types


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_gguf_block_attention")
    model = make_tiny_model(seed=5, hidden_size=H, intermediate_size=256, num_hidden_layers=LAYERS,
                            num_local_experts=4, num_experts_per_tok=2)
    cfg = model.config
    d = H // cfg.num_attention_heads
    rows = {"q": cfg.num_attention_heads * d, "k": cfg.num_key_value_heads * d, "v": cfg.num_key_value_heads * d}
    raw = {f"blk.{i}.attn_{p}.weight": (random_k_experts(TYPES[p], 1, n, 10 * i + j, H)[0], getattr(T, TYPES[p]))
           for i in range(LAYERS) for j, (p, n) in enumerate(rows.items())}  # (gguf-py cannot write K-quants)
    out = root / "m.gguf"
    write_gguf(model, out, expert_types=T.Q8_0, other_type=T.Q8_0, raw_tensors=raw)  # o_proj: Q8_0 of the model's
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield out
    mp.undo()


def _decode(model: MoEModel, ids: torch.Tensor, native: bool, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens and the lm_head's input at every pass, the layers in one call or one by one."""
    model.model.layers_step.enabled = native
    seen: list[torch.Tensor] = []
    hook = model.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
    finally:
        hook.remove()
        model.model.layers_step.enabled = True
    return out, seen


def test_attention_on_the_files_blocks(path, monkeypatch):
    seen: list[str] = []
    inner = gguf_reader.dequantize
    monkeypatch.setattr(gguf_reader, "dequantize", lambda raw, t, what: seen.append(what.rsplit(": ", 1)[-1])
                        or inner(raw, t, what))
    model = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu")
    monkeypatch.setattr(gguf_reader, "dequantize", inner)
    try:
        assert not {n for n in seen if ".attn_" in n and not n.endswith("norm.weight")}, seen  # none dequantized
        reader = open_gguf(path).reader
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for p, gg in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "output")):
                lin = getattr(attn, p)
                assert isinstance(lin, GGUFLinear) and lin.type.name == TYPES[gg], (i, p)
                want = reader.get(f"model.layers.{i}.self_attn.{p}.weight")  # (un-permuted, dequantized)
                assert torch.equal(dequantize(lin.blocks, lin.type.type_id).view_as(want), want), (i, p)
            qkv = attn.qkv_proj
            assert isinstance(qkv, SplitLinear) and qkv.parts[0] is attn.q_proj and attn.fused_step
            kv = qkv.parts[1]
            assert isinstance(kv, GGUFLinear) and kv.type.name == "Q6_K"
            assert attn.k_proj.blocks.data_ptr() == kv.blocks.data_ptr()  # k's rows: a view of the fused matrix
        assert model.model.layers_step is not None and model.model.layers[0].attention_step is not None
    finally:
        model.close()


def test_one_call_is_the_per_layer_path_on_1_2_3_threads(path, monkeypatch):
    calls = [0]
    inner = cpu_layers.layers_step

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(cpu_layers, "layers_step", counted)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        ref, ref_x = _decode(model, ids, native=False, n=4)
        assert calls[0] == 0
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            calls[0] = 0
            out, x = _decode(model, ids, native=True, n=4)
            assert calls[0] == 3 and torch.equal(out, ref), f"{t} threads"
            assert all(torch.equal(a, b) for a, b in zip(x, ref_x, strict=True)), f"{t} threads"
    finally:
        torch.set_num_threads(threads)
        model.close()


def test_every_policy_gives_the_resident_tokens(path):
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=[])
    resident = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu",
                                        offload=OffloadConfig(policy="resident"))
    try:
        assert isinstance(resident.model.layers[0].self_attn.o_proj, GGUFLinear)
        expected = resident.generate(ids, **kw)
    finally:
        resident.close()
    for policy, cpu_compute in (("lru", None), ("ondemand", None), ("fiddler", None), ("lru", "always")):
        extra = {} if cpu_compute is None else {"cpu_compute": cpu_compute}
        model = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=2, transport="random-delay", random_delay_ms=0.2, seed=3, **extra))
        try:
            assert torch.equal(model.generate(ids, **kw), expected), (policy, cpu_compute)
        finally:
            model.close()


def test_attention_bits_4_keeps_the_path_before(path):
    model = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu", attention_bits=4)
    try:
        attn = model.model.layers[0].self_attn
        assert all(isinstance(getattr(attn, p), CpuQuantLinear) and getattr(attn, p).bits == 4
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    finally:
        model.close()
