"""The pool's panel-major AWQ ``qweight`` (``[K/P, N, P/8]``: one kernel K iteration reads one contiguous range)
under TRITON_INTERPRET=1: the expert GEMM reads it by strides, so the same weights in the former row-major
layout (``[N, K/8]`` viewed as panels, ``pool.rows_as_panels``) give bitwise the same output (what lets the GPU
benchmark time both); panels of groups 32 / 64 / 128 and BLOCK_K below the panel; the packed linear and the
fused q/k/v views; errors name the tensor."""

from __future__ import annotations

import pytest
import torch

from moeflow import kernels
from moeflow.kernels.experts.gemm import expert_gemm
from moeflow.kernels.experts.reference import dequantize_kernel_layout, routing_plan_reference
from moeflow.kernels.formats import expert_format
from moeflow.kernels.formats.plain_layout import awq_panel, qweight_rows, rows_as_panels
from moeflow.kernels.pool import ExpertPool
from moeflow.quant.awq import dequantize, quantize_rtn
from tests.test_kernels_fused import _awq_expert

E, K_TOP = 3, 2


def _pool(H: int, I: int, g: int, seed: int = 0) -> ExpertPool:  # noqa: E741
    fmt = expert_format(H, I, "awq", torch.float32, g)
    pool = ExpertPool.allocate(fmt, E, "cpu")
    for e in range(E):
        fmt.write(pool.buffer[e], _awq_expert(H, I, g, torch.float32, seed=seed + e))
    return pool


def _launch(pool: ExpertPool, qweight: torch.Tensor, mode: int, a: torch.Tensor, ids: torch.Tensor,
            cfg: dict) -> torch.Tensor:
    name = "w13" if mode == 0 else "w2"
    t = pool.tensors
    sorted_ids, eob, _ = routing_plan_reference(ids, E, cfg["BLOCK_M"])
    P = ids.numel()
    n_out = t[f"{name}_scales"].shape[-1] // (2 if mode == 0 else 1)
    out = torch.full((P, n_out), float("nan"))
    expert_gemm(mode, a, (qweight, t[f"{name}_qzeros"], t[f"{name}_scales"]), out, sorted_ids, eob,
                torch.arange(E, dtype=torch.int32), None, None, P, K_TOP if mode == 0 else 1,
                pool.fmt.group_size, cfg)
    return out


@pytest.mark.parametrize(("H", "I", "g", "block_k", "split"), [
    (256, 128, 128, 128, 1),  # BLOCK_K = panel: every tile at a panel's start
    (256, 128, 128, 64, 1),  # two tiles per panel (the prefill tile)
    (256, 128, 128, 32, 2),  # four tiles per panel, split K
    (128, 192, 64, 64, 2),
    (128, 64, 32, 32, 4),  # rows 16 bytes apart: the compile-time row stride keeps the loads whole
])
def test_panel_and_row_major_layouts_give_the_same_bits(H, I, g, block_k, split):  # noqa: E741
    pool = _pool(H, I, g)
    gen = torch.Generator().manual_seed(1)
    T = 3
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(T)]).to(torch.int32)
    x = torch.randn(T, H, generator=gen)
    h = torch.randn(T * K_TOP, I, generator=gen)
    cfg = {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split}
    P = awq_panel(g)
    for mode, name, a in ((0, "w13", x), (1, "w2", h)):
        panels = pool.tensors[f"{name}_qweight"]  # [E, K/P, N, P/8], each slot's panels contiguous
        n = panels.shape[-2]
        assert panels.shape[-1] * 8 == P and panels.stride()[1:] == (n * P // 8, P // 8, 1)
        rows = qweight_rows(panels)  # [E, N, K/8]: the former layout, its own memory
        old = rows_as_panels(rows, P)
        assert old.data_ptr() == rows.data_ptr() and old.stride(-2) == rows.shape[-1]
        got = _launch(pool, panels, mode, a, ids, cfg)
        ref = _launch(pool, old, mode, a, ids, cfg)
        assert not got.isnan().any()
        assert torch.equal(got, ref), (mode, block_k, split)
        # and both are the GEMM of the dequantized weights
        if mode == 1:
            t = pool.tensors
            w = [dequantize_kernel_layout(t["w2_qweight"][e], t["w2_qzeros"][e], t["w2_scales"][e], g)
                 for e in range(E)]
            want = torch.stack([h[p] @ w[int(e)].T for p, e in enumerate(ids.reshape(-1))])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_packed_linear_and_fused_views_read_the_panels():
    gen = torch.Generator().manual_seed(2)
    K, N, g = 256, 96, 64
    q = quantize_rtn(torch.randn(K, N, generator=gen).T.contiguous(), g)  # [N, K] rows -> AWQ [K, N/8]
    packed = kernels.pack_awq_linear(q.qweight, q.qzeros, q.scales)
    assert tuple(packed["qweight"].shape) == (K // g, N, g // 8)
    x = torch.randn(5, K, generator=gen)
    x = x.half()
    want = x.float() @ dequantize(q.qweight, q.qzeros, q.scales.float(), g)  # fp32 reference
    got = kernels.awq_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], g, backend="triton",
                             packed=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))
    # a column slice of the panels (the fused q/k/v linears' views) is read by stride
    sl = slice(32, 96)
    view = packed["qweight"][:, sl]
    assert not view.is_contiguous()
    got_slice = kernels.awq_linear(x, view, packed["qzeros"][:, 4:12], packed["scales"][:, sl], g,
                                   backend="triton", packed=True)
    assert torch.equal(got_slice, got[:, sl])


def test_a_row_major_qweight_is_refused_by_name():
    pool = _pool(128, 64, 32)
    t = pool.tensors
    rows = qweight_rows(t["w2_qweight"][0])  # [N, K/8]: the former layout, not the packed linear's
    with pytest.raises(ValueError, match="qweight must have shape"):
        kernels.awq_linear(torch.randn(2, 64), rows, t["w2_qzeros"][0], t["w2_scales"][0], 32, backend="triton",
                           packed=True)
