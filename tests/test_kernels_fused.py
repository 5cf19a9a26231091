"""The pool's kernel layout (conversion at load, exact inverse), the fused route + plan launch, the split-K
reduction folded into the combine, and the launch count of a decode step (interpreter: TRITON_INTERPRET=1)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _check_plan_invariants, _pool, assert_close, make_pool, make_routing

from moeflow import kernels
from moeflow.kernels import workspace
from moeflow.kernels.experts import ops
from moeflow.kernels.experts.reference import (
    combine_partials_reference,
    combine_reference,
    expert_forward_reference,
    route_reference,
    routing_plan_reference,
)
from moeflow.kernels.formats import expert_format
from moeflow.kernels.formats.plain_layout import awq_panel, qweight_rows
from moeflow.quant.awq import quantize_rtn, unpack_int4

# ---------------------------------------------------------------------------------------------------------
# layout


def _awq_expert(H: int, I: int, g: int, dtype: torch.dtype, seed: int) -> dict:  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    a = quantize_rtn(torch.randn(2 * I, H, generator=gen), g)
    b = quantize_rtn(torch.randn(H, I, generator=gen), g)
    return {"w13_qweight": a.qweight, "w13_qzeros": a.qzeros, "w13_scales": a.scales.to(dtype),
            "w2_qweight": b.qweight, "w2_qzeros": b.qzeros, "w2_scales": b.scales.to(dtype)}


@pytest.mark.parametrize(("H", "I", "g", "dtype"), [(64, 96, 32, torch.float16), (128, 64, 64, torch.bfloat16),
                                                    (256, 128, 128, torch.float32)])
def test_layout_round_trip_is_bit_exact_and_keeps_the_bytes(H, I, g, dtype):  # noqa: E741
    fmt = expert_format(H, I, "awq", dtype, g)
    src = _awq_expert(H, I, g, dtype, seed=H + I)
    region = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    fmt.write(region, src)
    back = fmt.loader_tensors(region)
    assert set(back) == set(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    published = sum(t.numel() * t.element_size() for t in src.values())
    assert published <= fmt.nbytes <= published * 1.01 + 6 * 256  # same bytes, up to the 256-byte alignment
    # the documented layout: nibble i of word (p, n, j) is q[pP + 8j + i, column] with P the group (<= 128),
    # w13 columns interleaved gate / up
    q = unpack_int4(src["w13_qweight"])  # [H, 2I]
    kq = fmt.views(region.view(1, -1))["w13_qweight"][0]  # [H/P, 2I, P/8]
    P = awq_panel(g)
    assert P == g and tuple(kq.shape) == (H // P, 2 * I, P // 8) and kq.is_contiguous()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        p, n, j, i = (int(torch.randint(0, m, (1,), generator=gen)) for m in (H // P, 2 * I, P // 8, 8))
        col = n // 2 + (I if n % 2 else 0)
        assert (int(kq[p, n, j]) >> (4 * i)) & 0xF == int(q[p * P + 8 * j + i, col])
    # one kernel K iteration (BLOCK_N rows x one panel) is one contiguous byte range: rows P/2 bytes apart
    assert kq.stride(1) == P // 8 and kq.stride(0) == 2 * I * P // 8
    # qweight_rows: the [N, K/8] view of the same nibbles
    rows = qweight_rows(kq)
    assert tuple(rows.shape) == (2 * I, H // 8)
    assert torch.equal(rows[:, P // 8:2 * P // 8] if H // P > 1 else rows, kq[1] if H // P > 1 else kq[0])


def test_dense_layout_round_trip_and_write_errors():
    fmt = expert_format(48, 40, "dense", torch.float16)
    src = {"w13": torch.randn(80, 48).half(), "w2": torch.randn(48, 40).half()}
    region = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    fmt.write(region, src)
    back = fmt.loader_tensors(region)
    assert torch.equal(back["w13"], src["w13"]) and torch.equal(back["w2"], src["w2"])
    awq = expert_format(64, 96, "awq", torch.float16, 32)
    bad = _awq_expert(64, 96, 32, torch.float16, 0)
    with pytest.raises(ValueError, match="expected"):
        awq.write(torch.zeros(awq.nbytes, dtype=torch.uint8), {**bad, "w2_qweight": bad["w2_qweight"].T})
    with pytest.raises(ValueError, match="must be int32"):
        awq.write(torch.zeros(awq.nbytes, dtype=torch.uint8), {**bad, "w13_qzeros": bad["w13_qzeros"].long()})
    with pytest.raises(KeyError, match="w2_scales"):
        awq.write(torch.zeros(awq.nbytes, dtype=torch.uint8), {k: v for k, v in bad.items() if k != "w2_scales"})


# ---------------------------------------------------------------------------------------------------------
# router (softmax / top-k / renormalise) and the fused plan


@pytest.mark.parametrize(("T", "E", "k", "renorm"), [(1, 8, 2, True), (5, 7, 1, True), (9, 5, 5, False),
                                                     (37, 13, 3, True), (3, 2, 2, True)])
def test_route_matches_reference(T, E, k, renorm):
    gen = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=gen) * 3  # fp32: no ties, so the ids are unique
    ids, w = kernels.route(logits, k, "triton", renormalize=renorm)
    ref_ids, ref_w = route_reference(logits, k, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (T, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    t_ids, t_w = kernels.route(logits, k, "torch", renormalize=renorm)
    assert torch.equal(t_ids, ref_ids) and torch.equal(t_w, ref_w)
    # bf16 logits tie often: any top-k is right, its weights must be the reference's (ties: lowest expert here)
    ids, w = kernels.route(logits.to(torch.bfloat16), k, "triton", renormalize=renorm)
    _, ref_w = route_reference(logits.to(torch.bfloat16), k, renorm)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    assert bool((ids.sort(dim=1).values[:, 1:] != ids.sort(dim=1).values[:, :-1]).all())  # distinct experts


def test_route_with_the_gate_fused():
    T, H, E, k = 3, 96, 7, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).half()
    gate = (torch.randn(E, H, generator=gen) / 4).half()
    ids, w = kernels.route(x, k, "triton", gate=gate)
    ref_ids, ref_w = route_reference(F.linear(x, gate), k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=2e-3, atol=2e-3)  # fp16 logits: one rounding, another sum order
    with pytest.raises(ValueError, match="top_k=8"):
        kernels.route(x, 8, "triton", gate=gate)


@pytest.mark.parametrize(("T", "E", "k", "bm"), [(1, 8, 2, 1), (6, 5, 2, 4), (30, 13, 3, 16), (4, 4, 4, 2)])
def test_fused_route_plan_gives_the_reference_plan(T, E, k, bm):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
    placeholder = torch.empty((T, k), dtype=torch.int32)
    ids, w, *plan = ops.plan_eager(placeholder, E, bm, ops.fresh, logits=logits)
    ref_ids, ref_w = route_reference(logits, k)
    assert torch.equal(ids.view(T, k), ref_ids)
    torch.testing.assert_close(w.view(T, k), ref_w, rtol=1e-5, atol=1e-6)
    ref_plan = routing_plan_reference(ref_ids, E, bm)
    _check_plan_invariants(ref_ids, E, bm, plan)
    for got, want in zip(plan, ref_plan, strict=True):
        assert torch.equal(got, want)


def test_moe_forward_from_router_logits():
    T, E, k, H, I, g = 5, 7, 2, 64, 96, 32  # noqa: E741
    pool = _pool(H, I, E, g, torch.float16)
    slot = torch.arange(E, dtype=torch.int32).flip(0).contiguous()
    x = torch.randn(T, H, dtype=torch.float16)
    logits = torch.randn(T, E, dtype=torch.float16)
    ids, w = route_reference(logits, k)
    ref = combine_reference(expert_forward_reference(x, ids, w, pool, slot, torch.empty(T * k, H, dtype=x.dtype)), k)
    for backend in ("triton", "torch"):
        got = kernels.moe_forward(x, None, None, pool, slot, backend, router_logits=logits, top_k=k)
        assert_close(got, ref, torch.float16)
        y, got_ids, got_w = kernels.moe_forward(x, None, None, pool, slot, backend, router_logits=logits, top_k=k,
                                                return_routing=True)
        assert torch.equal(y, got) and torch.equal(got_ids, ids)
        torch.testing.assert_close(got_w, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs top_k"):
        kernels.moe_forward(x, None, None, pool, slot, "triton", router_logits=logits)


# ---------------------------------------------------------------------------------------------------------
# split-K reduction folded into the combine


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_of_partials_matches_its_reference_bitwise(dtype):
    T, k, H, S = 5, 2, 100, 3
    gen = torch.Generator().manual_seed(2)
    partials = torch.randn(S, T * k, H, generator=gen)
    w = torch.rand(T * k, generator=gen)
    got = ops.combine_eager(None, k, torch.empty(T, H, dtype=dtype), partials, w)
    assert torch.equal(got, combine_partials_reference(partials, w, k, dtype))


def test_fused_split_k_equals_the_unfused_path_bitwise():
    """moe_forward (w2 partials summed in the combine) == expert_forward (reduce kernel) + combine, bit for bit."""
    T, k, E, H, I, g = 3, 2, 5, 64, 96, 32  # noqa: E741
    pool = _pool(H, I, E, g, torch.float16)
    slot = torch.arange(E, dtype=torch.int32)
    ids, w = make_routing(T, k, E, "uniform", 9)
    x = torch.randn(T, H, dtype=torch.float16)
    cfg = {"BLOCK_M": 4, "w13": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2},
           "w2": {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3}}
    fused = kernels.moe_forward(x, ids, w, pool, slot, "triton", config=cfg)
    out = torch.full((T * k, H), float("nan"), dtype=x.dtype)
    kernels.expert_forward(x, ids, w, pool, slot, out, None, "triton", config=cfg)
    assert torch.equal(fused, kernels.combine(out, k, "triton"))


# ---------------------------------------------------------------------------------------------------------
# launches and allocations of a decode step


@contextlib.contextmanager
def _count_launches():
    from triton.runtime.interpreter import InterpretedFunction

    names: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counting
    try:
        yield names
    finally:
        InterpretedFunction.run = run


def test_decode_step_is_four_launches_with_persistent_scratch():
    T, k, E, H, I, g = 1, 2, 8, 128, 256, 32  # noqa: E741  (the embedded model's shape; shipped CPU table)
    pool = make_pool(H, I, E, g, torch.bfloat16, seed=3)
    slot = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    logits = torch.randn(T, E, dtype=torch.bfloat16)
    split = {"BLOCK_M": 1, "w13": {"BLOCK_N": 256, "BLOCK_K": 32}, "w2": {"BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 2}}
    for cfg in (None, split):
        kernels.moe_forward(x, None, None, pool, slot, "triton", router_logits=logits, top_k=k, config=cfg)
        buffers = {key: buf.data_ptr() for key, buf in workspace._BUFFERS.items()}
        with _count_launches() as names:
            kernels.moe_forward(x, None, None, pool, slot, "triton", router_logits=logits, top_k=k, config=cfg)
        assert len(names) <= 4, names
        assert names[0] == "_route_plan_kernel" and names[-1] == "_combine_kernel"
        assert {key: buf.data_ptr() for key, buf in workspace._BUFFERS.items()} == buffers  # nothing reallocated


# ---------------------------------------------------------------------------------------------------------
# awq_linear on the packed (kernel) layout


@pytest.mark.parametrize(("M", "g", "kg", "n8", "dtype"), [(1, 32, 3, 5, torch.float16), (7, 64, 2, 12, torch.float32),
                                                          (40, 128, 1, 20, torch.bfloat16)])
def test_awq_linear_packed_matches_the_published_one(M, g, kg, n8, dtype):
    K, N = g * kg, 8 * n8
    gen = torch.Generator().manual_seed(M)
    q = quantize_rtn(torch.randn(N, K, generator=gen) / K**0.5, g)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ref = kernels.awq_linear(x, q.qweight, q.qzeros, q.scales.to(dtype), g, "torch")
    packed = kernels.pack_awq_linear(q.qweight, q.qzeros, q.scales.to(dtype))
    for backend in ("triton", "torch"):
        got = kernels.awq_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], g, backend, packed=True)
        assert got.shape == (M, N) and got.dtype == dtype
        assert_close(got, ref, dtype)
    with pytest.raises(ValueError, match="qweight must have shape"):
        kernels.awq_linear(x, q.qweight, packed["qzeros"], packed["scales"], g, "triton", packed=True)
