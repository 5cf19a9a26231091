"""Kernels against the torch reference under TRITON_INTERPRET=1 (set by conftest): plan, grouped GEMMs, combine,
expert-mask staging, awq_linear. Also the builders the other kernel test files share.

The interpreter costs ~20-40 ms per Triton program, so shapes are tiny and hypothesis example counts small.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from moeflow import kernels
from moeflow.kernels.experts.reference import (
    awq_linear_reference,
    combine_reference,
    expert_forward_reference,
    routing_plan_reference,
)
from moeflow.kernels.formats import expert_format
from moeflow.kernels.pool import ExpertPool
from moeflow.quant.awq import dequantize, quantize_rtn

TOL = {  # (rtol, atol relative to max |ref|): fp32 accumulation everywhere; bf16 allows the interpreter's truncation
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


def make_pool(
    hidden: int, inter: int, n_slots: int, group: int | None, dtype: torch.dtype, kind: str = "awq", seed: int = 0
) -> ExpertPool:
    """A CPU pool of ``n_slots`` random experts (AWQ round-to-nearest of Gaussian weights, or dense)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = expert_format(hidden, inter, kind, dtype, group)
    pool = ExpertPool.allocate(fmt, n_slots, "cpu")
    for s in range(n_slots):
        w13 = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
        w2 = torch.randn(hidden, inter, generator=gen) / inter**0.5
        if kind == "dense":
            fmt.write(pool.buffer[s], {"w13": w13.to(dtype), "w2": w2.to(dtype)})
            continue
        a, b = quantize_rtn(w13, group), quantize_rtn(w2, group)
        fmt.write(pool.buffer[s], {
            "w13_qweight": a.qweight, "w13_qzeros": a.qzeros, "w13_scales": a.scales.to(dtype),
            "w2_qweight": b.qweight, "w2_qzeros": b.qzeros, "w2_scales": b.scales.to(dtype),
        })
    return pool


def make_routing(
    T: int, k: int, E: int, mode: str = "uniform", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]); each token's k experts are distinct.

    mode "uniform": any experts; "skewed": only the first max(k, 2) experts (the others get no token);
    "one": every token's first choice is expert E - 1.
    """
    gen = torch.Generator().manual_seed(seed)
    if mode == "skewed":
        pool_e = max(k, 2)
        ids = torch.stack([torch.randperm(pool_e, generator=gen)[:k] for _ in range(T)])
    elif mode == "one":
        rest = [torch.randperm(E - 1, generator=gen)[: k - 1] for _ in range(T)]
        ids = torch.stack([torch.cat([torch.tensor([E - 1]), r]) for r in rest])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return ids.reshape(T, k).to(torch.int32), w


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(got).any(), "output has unwritten (NaN-poisoned) elements"
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(ref.float().abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * scale)


# ---------------------------------------------------------------------------------------------------------
# routing plan

SETTINGS = {  # no shrinking: each example costs seconds under the interpreter; failures print the drawn example
    "deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True, "database": None,
    "phases": [Phase.explicit, Phase.generate],
}


def _check_plan_invariants(ids: torch.Tensor, E: int, bm: int, plan) -> None:
    sorted_ids, eob, npad = plan
    P = ids.numel()
    flat = ids.reshape(-1).long()
    n = int(npad[0])
    assert n % bm == 0 and sorted_ids.numel() >= n and sorted_ids.numel() % bm == 0
    assert n <= P + E * (bm - 1)
    valid = sorted_ids[:n][sorted_ids[:n] < P].long()
    assert torch.equal(torch.sort(valid).values, torch.arange(P))  # every pair exactly once
    assert bool((sorted_ids[n:] == P).all()) and bool((eob[n // bm :] == -1).all())
    counts = torch.bincount(flat, minlength=E)
    assert int((eob[: n // bm] >= 0).sum()) == int(((counts + bm - 1) // bm).sum())  # empty experts: no block
    for b in range(n // bm):
        ps = sorted_ids[b * bm : (b + 1) * bm].long()
        ps = ps[ps < P]
        assert bool((flat[ps] == eob[b]).all())
        assert torch.equal(ps, torch.sort(ps).values)  # stable


@settings(max_examples=25, **SETTINGS)
@given(
    T=st.integers(1, 200), k=st.integers(1, 2), E=st.sampled_from([4, 5, 7, 8, 13, 16]),
    bm=st.sampled_from([1, 2, 4, 16, 64]), mode=st.sampled_from(["uniform", "skewed", "one"]), seed=st.integers(0, 99),
)
def test_plan_triton_matches_reference(T, k, E, bm, mode, seed):
    ids, _ = make_routing(T, k, E, mode, seed)
    ref = routing_plan_reference(ids, E, bm)
    _check_plan_invariants(ids, E, bm, ref)
    got = torch.ops.moeflow.routing_plan(ids, E, bm, "triton")
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_plan_int64_ids_and_empty():
    ids = torch.tensor([[3, 0], [3, 1]], dtype=torch.int64)
    for got, ref in zip(torch.ops.moeflow.routing_plan(ids, 4, 4, "triton"), routing_plan_reference(ids, 4, 4),
                        strict=True):
        assert torch.equal(got, ref)
    empty = torch.empty((0, 2), dtype=torch.int32)
    sorted_ids, eob, npad = torch.ops.moeflow.routing_plan(empty, 4, 4, "triton")
    assert int(npad[0]) == 0 and bool((eob == -1).all()) and bool((sorted_ids == 0).all())


# ---------------------------------------------------------------------------------------------------------
# expert forward (plan + w13 + w2) against the per-expert reference

DECODE_CFGS = [
    {"BLOCK_M": 1, "w13": {"BLOCK_N": 32, "BLOCK_K": 64}, "w2": {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}},
    {"BLOCK_M": 2, "w13": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}, "w2": {"BLOCK_N": 32, "BLOCK_K": 128}},
    {"BLOCK_M": 4, "w13": {"BLOCK_N": 64, "BLOCK_K": 128}, "w2": {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 3}},
]
PREFILL_CFGS = [
    {"BLOCK_M": 16, "w13": {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4}, "w2": {"BLOCK_N": 64, "BLOCK_K": 128}},
    {"BLOCK_M": 32, "w13": {"BLOCK_N": 128, "BLOCK_K": 32}, "w2": {"BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}},
    None,  # table lookup / heuristic default
]
_POOLS: dict = {}


def _pool(H, I, S, g, dtype, kind="awq"):  # noqa: E741
    key = (H, I, S, g, dtype, kind)
    if key not in _POOLS:
        _POOLS[key] = make_pool(H, I, S, g, dtype, kind, seed=len(_POOLS))
    return _POOLS[key]


def _run(x, ids, w, pool, slot, backend, cfg, mask=None, out=None):
    if out is None:
        out = torch.full((ids.numel(), x.shape[1]), float("nan"), dtype=x.dtype)
    return kernels.expert_forward(x, ids, w, pool, slot, out, mask, backend, config=cfg)


@settings(max_examples=10, **SETTINGS)
@given(
    data=st.data(), k=st.integers(1, 2), E=st.sampled_from([4, 5, 8, 13, 16]), g=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    mode=st.sampled_from(["uniform", "skewed", "one"]), decode=st.booleans(), seed=st.integers(0, 99),
)
def test_expert_forward_awq(data, k, E, g, dtype, mode, decode, seed):
    if decode:
        T = data.draw(st.integers(1, 6), label="T")
        cfg = data.draw(st.sampled_from(DECODE_CFGS), label="cfg")
    else:
        T = data.draw(st.integers(7, 160 if g == 32 else 60), label="T")
        cfg = data.draw(st.sampled_from(PREFILL_CFGS), label="cfg")
    H = g * data.draw(st.integers(1, 3 if g == 32 else 2), label="H/g")  # K of w13, N of w2: tails vs blocks
    I = g * data.draw(st.integers(1, 3 if g == 32 else 2), label="I/g")  # noqa: E741
    scale_dtype = data.draw(st.sampled_from([torch.float16, dtype]), label="scale dtype")
    pool = _pool(H, I, E + 1, g, scale_dtype)
    slot = torch.randperm(E + 1, generator=torch.Generator().manual_seed(seed))[:E].to(torch.int32)
    ids, w = make_routing(T, k, E, mode, seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ref = expert_forward_reference(x, ids, w, pool, slot, torch.full((T * k, H), float("nan"), dtype=dtype))
    got = _run(x, ids, w, pool, slot, "triton", cfg)
    assert_close(got, ref, dtype)
    if seed % 3 == 0:  # the torch backend reads the kernel layout: the oracle's values, at fp32 rounding
        torch.testing.assert_close(_run(x, ids, w, pool, slot, "torch", cfg).float(), ref.float(), rtol=1e-5,
                                   atol=1e-5 * max(1.0, float(ref.float().abs().max())))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cfg", [DECODE_CFGS[0], DECODE_CFGS[2], PREFILL_CFGS[0]])
def test_mask_staging_is_bitwise_single_pass(backend, cfg):
    T, k, E, H, I, g = 4 if cfg["BLOCK_M"] < 16 else 9, 2, 5, 64, 96, 32  # noqa: E741
    pool = _pool(H, I, 7, g, torch.float16)
    slot = torch.tensor([6, 0, 3, 2, 5], dtype=torch.int32)
    ids, w = make_routing(T, k, E, "uniform", 1)
    x = torch.randn(T, H, dtype=torch.float16)
    single = _run(x, ids, w, pool, slot, backend, cfg)
    staged = torch.full_like(single, float("nan"))
    flat = ids.reshape(-1).long()
    for stage in ([2], [0, 4], [], [1, 3]):
        mask = torch.zeros(E, dtype=torch.bool)
        mask[stage] = True
        before = staged.clone()
        _run(x, ids, w, pool, slot, backend, cfg, mask=mask, out=staged)
        untouched = ~mask[flat]
        assert torch.equal(staged[untouched].isnan(), before[untouched].isnan())  # other rows not touched
        assert torch.equal(staged[mask[flat]], single[mask[flat]])
    assert torch.equal(staged, single)
    assert torch.equal(kernels.combine(staged, k, backend), kernels.combine(single, k, backend))


def test_slot_table_with_unloaded_experts_and_mask():
    """Experts outside the mask may have slot -1 (not resident): they are neither read nor validated."""
    T, k, E = 6, 2, 4
    pool = _pool(64, 64, 3, 32, torch.float32)
    slot = torch.tensor([2, -1, 0, -1], dtype=torch.int32)
    mask = torch.tensor([True, False, True, False])
    ids, w = make_routing(T, k, E, "uniform", 3)
    x = torch.randn(T, 64)
    ref = expert_forward_reference(x, ids, w, pool, slot, torch.full((T * k, 64), float("nan")), mask)
    got = _run(x, ids, w, pool, slot, "triton", DECODE_CFGS[1], mask=mask)
    sel = mask[ids.reshape(-1).long()]
    assert_close(got[sel], ref[sel], torch.float32)
    assert bool(got[~sel].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", [DECODE_CFGS[0], PREFILL_CFGS[1]])
def test_expert_forward_dense_pool(dtype, cfg):
    T, k, E, H, I = 5, 2, 4, 48, 40  # noqa: E741
    pool = _pool(H, I, E, None, dtype, kind="dense")
    slot = torch.arange(E, dtype=torch.int32).flip(0).contiguous()
    ids, w = make_routing(T, k, E, "uniform", 4)
    x = torch.randn(T, H).to(dtype)
    ref = expert_forward_reference(x, ids, w, pool, slot, torch.full((T * k, H), float("nan"), dtype=dtype))
    assert_close(_run(x, ids, w, pool, slot, "triton", cfg), ref, dtype)


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_moe_forward_matches_reference(backend):
    T, k, E, H, I, g = 12, 2, 8, 128, 64, 64  # noqa: E741
    pool = _pool(H, I, E, g, torch.bfloat16)
    slot = torch.arange(E, dtype=torch.int32)
    ids, w = make_routing(T, k, E, "skewed", 5)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ref = combine_reference(expert_forward_reference(x, ids, w, pool, slot, torch.empty(T * k, H, dtype=x.dtype)), k)
    assert_close(kernels.moe_forward(x, ids, w, pool, slot, backend), ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# combine and awq_linear


@settings(max_examples=6, **SETTINGS)
@given(T=st.integers(1, 40), k=st.integers(1, 3), H=st.sampled_from([8, 96, 1100]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_combine_bitwise(T, k, H, dtype):
    y = torch.randn(T * k, H).to(dtype)
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 stores: 1 ulp (a GPU rounds)
        torch.testing.assert_close(kernels.combine(y, k, "triton"), combine_reference(y, k), rtol=2**-7, atol=0)
    else:
        assert torch.equal(kernels.combine(y, k, "triton"), combine_reference(y, k))
    # the torch backend against an fp64 sum (not the reference it calls): within one rounding to dtype
    exact = y.double().reshape(T, k, H).sum(1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(kernels.combine(y, k, "torch").double(), exact.to(dtype).double(), rtol=eps,
                               atol=eps * float(y.double().abs().max()) * k)


@settings(max_examples=8, **SETTINGS)
@given(M=st.integers(1, 70), g=st.sampled_from([32, 64, 128]), kg=st.integers(1, 3), n8=st.sampled_from([1, 5, 12, 20]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 9))
def test_awq_linear(M, g, kg, n8, dtype, seed):
    K, N = g * kg, 8 * n8
    gen = torch.Generator().manual_seed(seed)
    q = quantize_rtn(torch.randn(N, K, generator=gen) / K**0.5, g)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ref = awq_linear_reference(x, q.qweight, q.qzeros, q.scales, g)
    cfg = {"BLOCK_M": 16 if M > 8 else 2, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2 if M <= 8 else 1}
    got = kernels.awq_linear(x, q.qweight, q.qzeros, q.scales, g, "triton", config=cfg if seed % 2 else None)
    assert got.shape == (M, N) and got.dtype == dtype
    assert_close(got, ref, dtype)
    # the torch backend against an fp64 product of the dequantized weights (not the reference it calls)
    exact = x.double() @ dequantize(q.qweight, q.qzeros, q.scales.double(), g)
    assert_close(kernels.awq_linear(x, q.qweight, q.qzeros, q.scales, g, "torch"), exact.to(dtype), dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tokens(backend):
    pool = _pool(64, 64, 4, 32, torch.float32)
    slot = torch.arange(4, dtype=torch.int32)
    x = torch.empty(0, 64)
    y = kernels.moe_forward(x, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2), pool, slot, backend)
    assert y.shape == (0, 64)
    q = quantize_rtn(torch.randn(16, 64), 32)
    assert kernels.awq_linear(x, q.qweight, q.qzeros, q.scales, 32, backend).shape == (0, 16)
