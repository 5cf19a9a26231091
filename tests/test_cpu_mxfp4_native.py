"""The native MXFP4 CPU expert (``moeflow/kernels/cpu/mxfp4.c``): MXFP4 weights read as the host store holds them
(the region's K panels and permuted bits) times int8 activations, gpt-oss's epilogue. Against its fp32 model
(:func:`mxfp4_native_reference`: the same int8 activations, exact weights, fp32 sums in another order) within
MODEL_RTOL; against the fp32 expert (unquantized activations) within INT8_ACT_RTOL; a token's result independent
of the batch, bit for bit; the CPU form views of the host store's region (no extra RAM). ~3 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

from moeflow.kernels.cpu.mxfp4_native import (
    Mxfp4NativeExpert,
    Mxfp4RegionMatrix,
    mxfp4_native_reference,
    quantize_activations,
)
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.experts.biased import gate_activation
from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4
from moeflow.kernels.formats import biased_expert_format
from moeflow.offload.host_store import HostStore

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

MODEL_RTOL = 1e-5  # max |kernel - model| / max |model|: fp32 summation order only (measured ~4e-7)
INT8_ACT_RTOL = 5e-2  # relative norm against the fp32 expert: int8 activations before w13 and w2 (measured 1-2.5%)


def mxfp4_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Published-layout blocks uint8 [n, k/32, 16] and scales [n, k/32] with varied block exponents."""
    g = torch.Generator().manual_seed(seed)
    block_scale = torch.exp2(torch.randint(-6, 3, (n, k // 32, 1), generator=g).float())
    return quantize_mxfp4((torch.randn(n, k // 32, 32, generator=g) * block_scale).view(n, k))


def expert_tensors(H: int, I: int, dtype: torch.dtype, bias: bool, seed: int) -> dict[str, torch.Tensor]:  # noqa: E741
    (b13, s13), (b2, s2) = mxfp4_weights(2 * I, H, seed), mxfp4_weights(H, I, seed + 1)
    t = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2}
    if bias:
        g = torch.Generator().manual_seed(seed + 2)
        t |= {"w13_bias": torch.randn(2 * I, generator=g).to(dtype), "w2_bias": torch.randn(H, generator=g).to(dtype)}
    return t


def odd_row_matrices() -> list[Mxfp4RegionMatrix]:
    """Region matrices of random codes and exponents 118-129 whose row counts leave tails in mxfp4.c's loops: 13
    rows (8 + 2 x 2 + 1) in 64- and 32-input panels, and 2100 rows (one token's tile holds 2048: two tiles)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n, k, panel in ((13, 128, 64), (13, 96, 32), (2100, 64, 64)):
        blocks = torch.randint(0, 256, (k // panel, n, panel // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 130, (k // panel, n, panel // 32), generator=g, dtype=torch.uint8)
        out.append(Mxfp4RegionMatrix(blocks, scales, f"{n}x{k}"))
    return out


def fp32_expert(t: dict[str, torch.Tensor], fmt, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    h = rows.float() @ dequantize_mxfp4(t["w13_blocks"], t["w13_scales"]).T
    if fmt.bias:
        h = h + t["w13_bias"].float()
    y = gate_activation(h, fmt) @ dequantize_mxfp4(t["w2_blocks"], t["w2_scales"]).T
    if fmt.bias:
        y = y + t["w2_bias"].float()
    return y * weights[:, None]


# (H, I): 64-input panels; 32-input panels with an odd number of blocks (96 = 3 blocks, 160 = 5)
@pytest.mark.parametrize("H,I,dtype,bias,activation", [
    (64, 128, torch.float32, True, "clamped_swiglu"),
    (96, 160, torch.bfloat16, True, "clamped_swiglu"),
    (128, 64, torch.float16, False, "clamped_swiglu"),
    (64, 96, torch.bfloat16, True, "silu"),
])
def test_expert_matches_its_model_and_the_fp32_expert(H, I, dtype, bias, activation):  # noqa: E741
    fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=dtype, activation=activation,
                               bias=bias)
    t = expert_tensors(H, I, dtype, bias, seed=H + I)
    expert = fmt.cpu_expert(t)
    assert isinstance(expert, Mxfp4NativeExpert) and expert.nbytes == sum(
        v.numel() for k, v in t.items() if not k.endswith("_bias"))
    assert torch.equal(expert.w13.dequantized(), dequantize_mxfp4(t["w13_blocks"], t["w13_scales"]))
    g = torch.Generator().manual_seed(7)
    for tokens in (1, 3, 9, 17):  # token tiles of 8, 1-7 and their tails
        rows, weights = torch.randn(tokens, H, generator=g) * 4, torch.rand(tokens, generator=g)
        got = expert.forward(rows, weights)
        assert got.dtype == torch.float32 and got.shape == (tokens, H)
        model = mxfp4_native_reference(expert, rows, weights)
        assert float((got - model).abs().max() / model.abs().max()) < MODEL_RTOL
        fp32 = fp32_expert(t, fmt, rows, weights)
        assert float((got - fp32).norm() / fp32.norm()) < INT8_ACT_RTOL
        one_by_one = torch.cat([expert.forward(rows[i : i + 1], weights[i : i + 1]) for i in range(tokens)])
        assert torch.equal(one_by_one, got)  # a token's result does not depend on the batch
        acc = torch.ones(tokens, H)
        assert torch.equal(expert.forward(rows, weights, out=acc), 1 + got)


def test_linear_is_the_model_of_int8_activations_times_exact_weights():
    fmt = biased_expert_format(kind="mxfp4", hidden_size=96, intermediate_size=64, dtype=torch.float32,
                               activation="clamped_swiglu")
    expert = fmt.cpu_expert(expert_tensors(96, 64, torch.float32, True, seed=3))
    for m in (expert.w13, expert.w2):
        x = torch.randn(5, m.k, generator=torch.Generator().manual_seed(m.k))
        want = quantize_activations(x) @ m.dequantized().T
        assert float((m.matmul(x) - want).abs().max() / want.abs().max()) < MODEL_RTOL


def test_linear_rows_in_every_loop_tail_match_the_model():
    for m in odd_row_matrices():
        for t in (1, 5):
            x = torch.randn(t, m.k, generator=torch.Generator().manual_seed(t))
            want = quantize_activations(x) @ m.dequantized().T
            assert float((m.matmul(x) - want).abs().max() / want.abs().max()) < MODEL_RTOL, (m.name, t)


def test_region_views_are_the_form_and_hold_no_copy():
    """HostStore.cpu_expert of an MXFP4 store: views into the store's region, the same bits as the form built from
    the loader tensors (a disk read's path), no converted bytes (cpu_nbytes 0)."""
    H, I = 64, 96  # noqa: E741
    fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                               activation="clamped_swiglu")
    store = HostStore(fmt, 1, 2, pin=False, device="cpu")
    tensors = [expert_tensors(H, I, torch.bfloat16, True, seed=s) for s in (11, 12)]
    for e, t in enumerate(tensors):
        store.write(0, e, t)
    g = torch.Generator().manual_seed(1)
    rows, weights = torch.randn(4, H, generator=g), torch.rand(4, generator=g)
    lo, hi = store.buffer.data_ptr(), store.buffer.data_ptr() + store.buffer.numel()
    for e, t in enumerate(tensors):
        form = store.cpu_expert(0, e)
        assert isinstance(form, Mxfp4NativeExpert)
        for tensor in (form.w13.blocks, form.w13.scales, form.w2.blocks, form.w2.scales, form.b13, form.b2):
            assert lo <= tensor.data_ptr() < hi
        assert torch.equal(form.forward(rows, weights), fmt.cpu_expert(t).forward(rows, weights))
    assert store.cpu_nbytes == 0


def test_bad_matrices_are_named():
    blocks, scales = mxfp4_weights(8, 64, seed=0)
    with pytest.raises(ValueError, match="MXFP4 w13: expected contiguous CPU uint8 blocks"):
        Mxfp4RegionMatrix(blocks, scales, "w13")  # the published layout, not the region's panels


def test_thread_count_does_not_change_the_bits():
    """OpenMP over rows (work items sized by the thread count): 1, 2 and 3 threads give the same bits."""
    H, I = 128, 320  # noqa: E741
    fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                               activation="clamped_swiglu")
    expert = fmt.cpu_expert(expert_tensors(H, I, torch.bfloat16, True, seed=21))
    g = torch.Generator().manual_seed(2)
    rows, weights = torch.randn(6, H, generator=g), torch.rand(6, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(expert.forward(rows, weights))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
