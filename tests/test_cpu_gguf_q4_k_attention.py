"""A GGUF file's Q4_K attention projections (a Q4_K_M file's q / k) on ``device="cpu"`` (issue 42): read straight into
the CPU int4 form at group 32 (``s = d sc``, ``m = -(dmin mn)``: ``gguf_linears.q4_k_codes``), each weight exactly
the file's dequantized value (q / k rows un-permuted), each output the fp32 reference of those weights with the CPU
path's int8 activations; beside a Q8_0 v (k and v then int8; o: the file's Q8_0 blocks) the q/k/v projection runs in
two parts, Q4_K q, k, v fuse in int4; the one-call layers step gives the layers' own tokens, every policy the
resident model's. ~15 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_block_helpers import random_blocks  # noqa: E402
from gguf_models import T, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.engine.gguf_linears import GGUFStoredLinears, q4_k_codes  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402
from moeflow.kernels.cpu.gguf import GGUFLinear  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.kernels.cpu.q4_matrix import Q4_F32, Q4Matrix, group_rows, pack_q4  # noqa: E402
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, SplitLinear, reference_linear  # noqa: E402
from moeflow.quant.ggml import dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

H, HEADS, KV = 256, 4, 2  # a K-quant row needs 256 inputs; head_dim 64


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_gguf_q4_k_attn")
    model = make_tiny_model(seed=7, hidden_size=H, intermediate_size=64, num_attention_heads=HEADS,
                            num_key_value_heads=KV)
    g = torch.Generator().manual_seed(8)
    kv_rows = KV * H // HEADS  # layer 0: Q4_K q and k beside a Q8_0 v (k goes int8 with v); layer 1: q, k, v Q4_K
    raw = {f"blk.{layer}.attn_{p}.weight": (random_blocks("Q4_K", rows, H, g).numpy(), T.Q4_K)
           for layer, projs in ((0, ("q", "k")), (1, ("q", "k", "v"))) for p in projs
           for rows in ((H if p == "q" else kv_rows),)}
    path = root / "q4_k_attn.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_tensors=raw)
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield path
    mp.undo()


def test_q4_k_codes_are_the_dequantized_values():
    raw = random_blocks("Q4_K", 5, 512, torch.Generator().manual_seed(1))
    codes, s, m = q4_k_codes(raw)
    assert codes.shape == (5, 512) and s.shape == m.shape == (5, 16) and int(codes.max()) <= 15
    matrix = Q4Matrix(pack_q4(codes), group_rows(s), group_rows(m), 32)
    assert matrix.fmt == Q4_F32
    assert torch.equal(matrix.dequantized(), dequantize(raw.reshape(-1, 144), 12).reshape(5, 512))  # type 12: Q4_K


def test_stored_q4_k_layers_are_the_files_weights(q4_k_file):
    g = open_gguf(q4_k_file)
    stored = GGUFStoredLinears(g.reader, lambda m: f"model.{m}.weight")
    for p in ("q_proj", "k_proj"):  # rope-permuted in the file: rows moved back whole
        name = f"layers.1.self_attn.{p}"
        lin = stored.cpu_linear(name)
        assert isinstance(lin, CpuQuantLinear) and lin.native and (lin.bits, lin.group_size) == (4, 32)
        weight = g.reader.get(f"model.{name}.weight")
        assert torch.equal(Q4Matrix(lin.packed, lin.scales, lin.mins, 32).dequantized(), weight), name
        for tokens in (1, 5):
            x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
            ref = reference_linear(x, weight)
            torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert stored.cpu_linear("layers.0.self_attn.v_proj") is None  # Q8_0: int8 of its values, as before


def test_q4_k_attention_in_the_step_and_every_policy(q4_k_file):
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    resident = MoEModel.from_pretrained(q4_k_file, device="cpu", offload=OffloadConfig(policy="resident"))
    try:
        dec = resident.model
        split, fused = dec.layers[0].self_attn, dec.layers[1].self_attn
        assert (split.q_proj.bits, split.q_proj.group_size, split.k_proj.bits, split.v_proj.bits) == (4, 32, 8, 8)
        assert isinstance(split.qkv_proj, SplitLinear) and dec.layers_step is not None
        assert (fused.qkv_proj.bits, fused.qkv_proj.group_size) == (4, 32) and fused.fused_qkv
        assert isinstance(fused.o_proj, GGUFLinear) and fused.o_proj.type.name == "Q8_0"  # the file's blocks
        expected = resident.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
        dec.layers_step.enabled = False  # each layer's attention half in its own native call
        assert torch.equal(resident.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[]), expected)
    finally:
        resident.close()
    for policy in ("ondemand", "lru"):
        model = MoEModel.from_pretrained(q4_k_file, device="cpu", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=3, transport="random-delay", random_delay_ms=0.2, seed=1))
        try:
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
            assert torch.equal(out, expected), f"{policy}: {out} != {expected}"
        finally:
            model.close()
