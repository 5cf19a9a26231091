"""Biased experts (gpt-oss's clamped SwiGLU, biases on both projections) in the grouped AWQ Triton kernels, under
TRITON_INTERPRET=1 against the plain-torch reference on odd shapes: the epilogue option of
``triton_experts.expert_gemm`` (``bias`` + ``activation``), staged expert masks, the region layout round trip."""

from __future__ import annotations

import warnings

import pytest
import torch

from moeflow import kernels
from moeflow.kernels.experts.biased import biased_expert_forward_reference
from moeflow.kernels.formats import biased_expert_format
from moeflow.kernels.pool import ExpertPool
from moeflow.quant.awq import quantize_rtn


def awq_expert(H, I, g, gen, dtype):  # noqa: E741
    """Loader-form (AWQ as published) tensors of one random biased expert."""
    tensors = {}
    for name, (k, n) in (("w13", (H, 2 * I)), ("w2", (I, H))):
        q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.3, g)  # nn.Linear [out, in] -> AWQ [in, out/8]
        tensors.update({f"{name}_qweight": q.qweight, f"{name}_qzeros": q.qzeros, f"{name}_scales": q.scales.to(dtype)})
    tensors["w13_bias"] = (torch.randn(2 * I, generator=gen) * 2).to(dtype)
    tensors["w2_bias"] = torch.randn(H, generator=gen).to(dtype)
    return tensors


def biased_awq_pool(H, I, g, n_slots, gen, activation="clamped_swiglu", dtype=torch.float32):  # noqa: E741
    fmt = biased_expert_format(H, I, "awq", dtype, g, activation=activation, swiglu_limit=3.0)
    pool = ExpertPool.allocate(fmt, n_slots, "cpu")
    experts = [awq_expert(H, I, g, gen, dtype) for _ in range(n_slots)]
    for s, tensors in enumerate(experts):
        fmt.write(pool.buffer[s], tensors)
    return pool, experts


def test_region_round_trips_the_loader_form():
    gen = torch.Generator().manual_seed(0)
    pool, experts = biased_awq_pool(64, 96, 32, 2, gen)
    for s, tensors in enumerate(experts):
        back = pool.fmt.loader_tensors(pool.buffer[s])
        assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)
    # the kernel layout: w13 bias interleaved like the w13 columns (gate j, up j)
    assert torch.equal(pool.tensors["w13_bias"][0][0::2], experts[0]["w13_bias"][:96])


CASES = [  # (T, H, I, g, E, k, activation, dtype, config)
    (1, 64, 96, 32, 5, 2, "clamped_swiglu", torch.float32, None),  # decode
    (7, 96, 160, 32, 7, 3, "clamped_swiglu", torch.float32, None),  # odd T, I = 5 groups, prime E
    (5, 64, 96, 32, 3, 3, "silu", torch.float32, {"w13": {"BLOCK_N": 64}, "w2": {"BLOCK_N": 32}}),  # k = E
    (40, 64, 32, 32, 4, 1, "clamped_swiglu", torch.float32, None),  # k = 1, prefill-sized plan blocks
    (9, 128, 192, 64, 4, 2, "clamped_swiglu", torch.float16, None),  # fp16 activations and scales
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-g{c[3]}-E{c[4]}-k{c[5]}-{c[6]}-{c[7]}"
                                             for c in CASES])
def test_triton_matches_reference(case):
    T, H, I, g, E, k, act, dtype, config = case  # noqa: E741
    gen = torch.Generator().manual_seed(T * 13 + E)
    pool, _ = biased_awq_pool(H, I, g, E + 1, gen, act, dtype)
    slots = torch.randperm(E + 1, generator=gen)[:E].to(torch.int32)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel path applies: no "plain-torch reference" warning
        got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=dtype), backend="triton",
                                     config=config)
    # fp32: the same exact weights, fp32 accumulation in another order; fp16: h and the outputs rounded to fp16
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < tol
    # staged: the experts in two masks give bitwise the rows of one pass, and leave other rows alone
    one_pass = kernels.expert_forward(x, ids, w, pool, slots, torch.full((T * k, H), 7.0, dtype=dtype),
                                      backend="triton", config=config)
    staged = torch.full((T * k, H), 7.0, dtype=dtype)
    first = torch.zeros(E, dtype=torch.bool)
    first[::2] = True
    for mask in (first, ~first):
        kernels.expert_forward(x, ids, w, pool, slots, staged, mask, backend="triton", config=config)
    assert torch.equal(staged, one_pass)
    half = torch.full((T * k, H), 7.0, dtype=dtype)
    kernels.expert_forward(x, ids, w, pool, slots, half, first, backend="triton", config=config)
    untouched = ~first[ids.reshape(-1).long()]
    assert torch.equal(half[untouched], torch.full_like(half[untouched], 7.0))


def test_unreduced_split_k_refuses_an_epilogue_it_cannot_run():
    """Partials the caller sums (reduce=False) cannot carry a bias: it would be added once per split. (The
    in-kernel fixup adds it once, after the sum: tests/test_splitk_fixup.py.)"""
    from moeflow.kernels.experts.gemm import expert_gemm

    gen = torch.Generator().manual_seed(3)
    pool, _ = biased_awq_pool(64, 32, 32, 1, gen)
    t = pool.tensors
    with pytest.raises(ValueError, match="reduce=False"):
        expert_gemm(1, torch.zeros(1, 32), (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"]), torch.zeros(1, 64),
                    torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), None, None, 1, 1, 32,
                    {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}, bias=t["w2_bias"],
                    reduce=False)
