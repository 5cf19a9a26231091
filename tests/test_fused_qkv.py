"""q/k/v as one packed AWQ linear on the Triton (GPU) path, fused at load (TRITON_INTERPRET=1 here).

* the fused linear against the three it replaces (bitwise where the launch config is the same, as at these
  shapes) and against the fp32 reference of the dequantized weights; the three keep working as views of it;
* a decode layer's launches and ops, counted with ``benchmarks/host/eager_launches.py``'s counter: one GEMM for
  q/k/v (a build fact: fails if the projection silently splits again), no ``torch.cuda.current_stream`` per
  scratch request, no dense linear outside the router;
* the exact-token invariant: offloaded (lru, two slot counts) == resident, both with the fused projections;
* the families (Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5): tests/test_fused_qkv_families.py (a file of its own, so
  that ``--dist loadfile`` runs it beside this one).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint

from benchmarks.host import eager_launches as count_eager_launches
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.families.layers import QKV, AWQLinear, fuse_awq_linears
from moeflow.kernels.experts.configs import packed_linear_config
from moeflow.kernels.experts.reference import dequantize_kernel_layout
from moeflow.quant.awq import quantize_rtn
from moeflow.tools.quantize import quantize_checkpoint

GROUP = 32


@pytest.fixture(autouse=True)
def _no_value_checks(monkeypatch):
    # the CPU-only value checks of the kernels' arguments (skipped on a GPU) are not the GPU path's work
    monkeypatch.setenv("MOEFLOW_KERNEL_CHECKS", "0")


def _awq_linear(fan_in: int, fan_out: int, gen: torch.Generator, dtype: torch.dtype, bias: bool) -> AWQLinear:
    q = quantize_rtn(torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5, GROUP)
    lin = AWQLinear(fan_in, fan_out, GROUP, dtype, bias=bias)
    lin.qweight, lin.qzeros, lin.scales = q.qweight, q.qzeros, q.scales.to(dtype)
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(fan_out, generator=gen).to(dtype), requires_grad=False)
    lin.use_kernels("triton")
    return lin


@pytest.mark.parametrize(("dtype", "bias", "m", "widths"), [
    (torch.float32, False, 1, (256, 128, 128)), (torch.float16, True, 3, (256, 128, 128)),
    (torch.float32, True, 20, (256, 128, 128)), (torch.float32, False, 1, (128, 64, 64))])
def test_fused_projection_equals_the_three_and_the_fp32_reference(dtype, bias, m, widths):
    gen = torch.Generator().manual_seed(m)
    H = 128
    linears = [_awq_linear(H, n, gen, dtype, bias) for n in widths]
    x = torch.randn(1, m, H, generator=gen).to(dtype)
    apart = [lin(x) for lin in linears]
    fused = fuse_awq_linears(linears)
    assert fused is not None and fused.packed and fused.out_features == sum(widths)
    together = fused(x)
    cfg = packed_linear_config(m, sum(widths), H, GROUP)
    if all(packed_linear_config(m, n, H, GROUP) == cfg and n % cfg["BLOCK_N"] == 0 for n in widths):
        # the launch config each projection had, and each column at its place in a BLOCK_N tile: bit for bit
        assert torch.equal(together, torch.cat(apart, dim=-1))
    else:  # v's columns move inside their tile: the interpreter's dot rounds them differently (by an ulp)
        torch.testing.assert_close(together, torch.cat(apart, dim=-1), rtol=1e-6, atol=1e-6)
    # the fp32 reference: x @ dequantized W (+ bias), in fp32
    w = torch.cat([dequantize_kernel_layout(lin.qweight, lin.qzeros, lin.scales, GROUP) for lin in linears])
    want = x.float() @ w.T + (fused.bias.float() if bias else 0)
    torch.testing.assert_close(together.float(), want, rtol=1e-3 if dtype == torch.float16 else 1e-5,
                               atol=1e-2 if dtype == torch.float16 else 1e-5)
    # the three are views of the fused tensors now (memory held once) and still compute their columns
    for lin, before in zip(linears, apart, strict=True):
        assert lin.qweight.untyped_storage().data_ptr() == fused.qweight.untyped_storage().data_ptr()
        assert lin.scales.untyped_storage().data_ptr() == fused.scales.untyped_storage().data_ptr()
        assert torch.equal(lin(x), before)


def test_projections_that_cannot_share_a_matrix_are_left_alone():
    gen = torch.Generator().manual_seed(0)
    plain = [_awq_linear(64, 64, gen, torch.float32, False) for _ in QKV]
    assert fuse_awq_linears(plain[:2] + [_awq_linear(64, 64, gen, torch.float32, True)]) is None  # bias mixed
    assert fuse_awq_linears(plain[:2] + [_awq_linear(128, 64, gen, torch.float32, False)]) is None  # fan-in
    unpacked = AWQLinear(64, 64, GROUP, torch.float32)
    assert fuse_awq_linears(plain[:2] + [unpacked]) is None  # the torch path keeps AWQ's published layout
    assert fuse_awq_linears(plain[:2] + [torch.nn.Linear(64, 64)]) is None


@pytest.fixture(scope="module")
def mixtral_awq(tmp_path_factory):
    """q, k and v 128 wide (4 heads of 32, no GQA): each a whole BLOCK_N tile, fused or not (bitwise equal)."""
    d = tmp_path_factory.mktemp("fused_qkv")
    src = make_tiny_checkpoint(d / "fp32", seed=4, num_hidden_layers=2, hidden_size=128, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                               num_experts_per_tok=2)
    return quantize_checkpoint(src, d / "awq", group_size=GROUP, quantize_attention=True, progress=False)


def _prompt() -> torch.Tensor:
    return torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))


def _fused_attention(model) -> list[torch.nn.Module]:
    return [m for m in model.model.modules() if hasattr(m, "fused_qkv")]


def _decode_counts(model) -> tuple[list[dict], list[dict]]:
    """(per decode layer, per decode attention) launch and op counts, two decode steps of one row. The launches
    are counted, not interpreted (``execute=False``, as the counter does at Mixtral's shapes): which kernels a
    layer launches is decided on the host before any value is read back, and the values of these very launches
    are checked in test_offloaded_tokens_equal_resident_with_fused_projections (~14 s less here)."""
    calls = count_eager_launches.decode_counts(
        model, {"layers": list(model.model.layers), "attention": _fused_attention(model)}, _prompt()[:1], 3,
        aten=True, python=False, execute=False)
    return calls["layers"], calls["attention"]


def test_decode_layer_is_one_gemm_for_qkv(mixtral_awq):
    """Per decode layer: q/k/v one GEMM launch (a split K reduced inside it: the fixup), o_proj one, and the
    MoE block's; the three projections apart cost two GEMMs more. No torch linear but the
    router's; the scratch's stream key never builds a ``torch.cuda`` stream object."""
    model = MoEOffloadedMixtral.from_pretrained(mixtral_awq, kernels="triton")
    attention = _fused_attention(model)
    assert len(attention) == 2 and all(a.fused_qkv and a.qkv_proj.packed for a in attention)
    qkv = attention[0].qkv_proj  # its decode config splits K: the one launch below includes the fixup
    assert packed_linear_config(1, qkv.out_features, qkv.in_features, qkv.group_size)["SPLIT_K"] > 1
    layers, attn = _decode_counts(model)
    assert len(layers) == len(attn) == 2 * 2  # two decode steps, two layers
    for layer, a in zip(layers, attn, strict=True):
        assert a["triton._expert_gemm_kernel"] == 2 and a["triton"] == 2, a  # q/k/v fused + o_proj, nothing else
        assert layer["triton._expert_gemm_kernel"] == 4, layer  # + the MoE block's w13, w2
        assert layer.get("aten.linear", 0) == 1, layer  # the router; no dense projection
        assert layer.get("stream_objects", 0) == 0 and layer["raw_stream_queries"] > 0, layer
    for a in attention:  # the three projections apart: two GEMMs more per layer
        a.fused_qkv = False
    apart_layers, apart_attn = _decode_counts(model)
    assert [x["triton"] - y["triton"] for x, y in zip(apart_layers, layers, strict=True)] == [2] * 4
    assert all(a["triton._expert_gemm_kernel"] == 4 for a in apart_attn)


def test_offloaded_tokens_equal_resident_with_fused_projections(mixtral_awq):
    ids = _prompt()
    resident = MoEOffloadedMixtral.from_pretrained(mixtral_awq, kernels="triton")
    want = resident.generate(ids, max_new_tokens=5, eos_token_id=[])
    logits = resident(ids).logits
    for a in _fused_attention(resident):  # the three projections again (views of the fused matrix)
        a.fused_qkv = False
    assert torch.equal(resident(ids).logits, logits)  # same config and tile places at these shapes: bitwise
    assert torch.equal(resident.generate(ids, max_new_tokens=5, eos_token_id=[]), want)
    for slots in (2, 5):
        off = MoEOffloadedMixtral.from_pretrained(mixtral_awq, kernels="triton",
                                                  offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        try:
            assert all(a.fused_qkv for a in _fused_attention(off))
            assert torch.equal(off.generate(ids, max_new_tokens=5, eos_token_id=[]), want), slots
        finally:
            off.experts.close()
