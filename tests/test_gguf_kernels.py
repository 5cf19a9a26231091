"""The GGUF expert Triton kernels (``TRITON_INTERPRET=1`` on the CPU) against the fp32 reference: every block type,
mixed gate/up and down types, odd shapes, split-K on and off, fp32 and bf16 activations, expert_mask staging
bitwise. ~60 s on 2 cores (the interpreter is slow: tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from gguf_block_helpers import random_gguf_expert

from moeflow import kernels
from moeflow.kernels.experts.biased import biased_expert_forward_reference
from moeflow.kernels.formats import gguf_expert_format
from moeflow.kernels.pool import ExpertPool


def gguf_pool(gate_up, down, H, I, n_slots, gen, dtype=torch.float32):  # noqa: E741
    fmt = gguf_expert_format(gate_up, down, H, I, dtype)
    pool = ExpertPool.allocate(fmt, n_slots, "cpu")
    for s in range(n_slots):
        fmt.write(pool.buffer[s], random_gguf_expert(fmt, gen))
    return pool


def routing(T, E, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    return ids, torch.softmax(torch.randn(T, k, generator=gen), -1)


def rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


CASES = [  # (gate/up type, down type, T, H, I, E, k, config)
    ("Q8_0", "Q8_0", 1, 96, 160, 5, 2, None),  # decode, K = 3 and 5 blocks, rows past the w2 tile (96 of 128)
    ("Q4_0", "Q4_0", 7, 96, 160, 7, 3, {"w13": {"BLOCK_N": 128}}),  # odd T, prime E, w13 tiles past I
    ("Q4_0", "Q8_0", 3, 64, 96, 4, 2, {"BLOCK_M": 2, "w13": {"BLOCK_N": 16, "BLOCK_K": 32}}),  # small tiles
    ("Q4_K", "Q6_K", 3, 256, 256, 4, 2, {"w13": {"BLOCK_K": 128}, "w2": {"BLOCK_N": 128, "BLOCK_K": 128}}),
    ("Q4_K", "Q4_K", 1, 256, 256, 3, 2, {"w13": {"BLOCK_N": 128, "BLOCK_K": 128}, "w2": {"BLOCK_K": 256}}),
    ("Q6_K", "Q5_K", 2, 256, 256, 3, 2, {"w13": {"BLOCK_N": 128, "BLOCK_K": 128}, "w2": {"BLOCK_K": 128}}),
    ("Q4_1", "Q5_0", 3, 96, 160, 5, 2, None),  # llama-quantize's fallbacks for rows not a multiple of 256
    ("Q5_1", "Q5_1", 2, 64, 96, 3, 2, {"w13": {"BLOCK_N": 128}}),
]


def _with_split(config, split):
    config = config or {}
    return {**config, **{s: {**config.get(s, {}), "SPLIT_K": split} for s in ("w13", "w2")}}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-T{c[2]}-H{c[3]}-I{c[4]}" for c in CASES])
def test_triton_matches_reference(case):
    gate_up, down, T, H, I, E, k, config = case  # noqa: E741
    gen = torch.Generator().manual_seed(T * 31 + E)
    pool = gguf_pool(gate_up, down, H, I, E + 1, gen)
    slots = torch.randperm(E + 1, generator=gen)[:E].to(torch.int32)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, k, gen)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H))
    assert float(want.abs().max()) > 1e-3  # the case computes something
    for split in (1, 2):
        got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), backend="triton",
                                     config=_with_split(config, split))
        assert rel_err(got, want) < 1e-5, split
    # staged (split-K on): the experts in two masks give bitwise the rows of one pass; others are untouched
    cfg = _with_split(config, 2)
    one_pass = kernels.expert_forward(x, ids, w, pool, slots, torch.full((T * k, H), 7.0), backend="triton",
                                      config=cfg)
    staged = torch.full((T * k, H), 7.0)
    first = torch.zeros(E, dtype=torch.bool)
    first[::2] = True
    kernels.expert_forward(x, ids, w, pool, slots, staged, first, backend="triton", config=cfg)
    untouched = ~first[ids.reshape(-1).long()]
    assert torch.equal(staged[untouched], torch.full_like(staged[untouched], 7.0))
    kernels.expert_forward(x, ids, w, pool, slots, staged, ~first, backend="triton", config=cfg)
    assert torch.equal(staged, one_pass)


@pytest.mark.parametrize("gate_up, down, H, I, dtype", [("Q8_0", "Q4_0", 96, 64, torch.bfloat16),
                                                        ("Q4_K", "Q6_K", 256, 256, torch.bfloat16),
                                                        ("Q5_0", "Q8_0", 64, 96, torch.float16)])
def test_triton_16_bit_activations(gate_up, down, H, I, dtype):  # noqa: E741
    gen = torch.Generator().manual_seed(5)
    T, E, k = 3, 4, 2
    pool = gguf_pool(gate_up, down, H, I, E, gen, dtype)
    slots = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids, w = routing(T, E, k, gen)
    cfg = {"w13": {"BLOCK_N": 128, "BLOCK_K": 128}, "w2": {"BLOCK_K": 128}}
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=dtype))
    got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=dtype), backend="triton",
                                 config=cfg)
    # h and the outputs stored in 16 bits (the interpreter truncates fp32 -> bf16 instead of rounding; fp16 weights
    # are rounded for the MMA): a few ulps
    assert rel_err(got, want) < 2e-2


def test_triton_prefill_shares_experts():
    """Prefill: 20 tokens, every one on expert 3, 16-row plan blocks (the default BLOCK_M)."""
    gen = torch.Generator().manual_seed(9)
    T, H, I, E, k = 20, 64, 96, 4, 2  # noqa: E741
    pool = gguf_pool("Q4_0", "Q8_0", H, I, E, gen)
    slots = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.tensor([3, j % 3]) for j in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H))
    got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), backend="triton")
    assert rel_err(got, want) < 1e-5
    y = kernels.moe_forward(x, ids, w, pool, slots, "triton")
    torch.testing.assert_close(y, kernels.combine(want, k), rtol=1e-5, atol=1e-5)


def test_triton_two_types_per_matrix():
    """One format for layers of different block types (Q4_K_M: down in Q6_K or Q4_K by layer; here gate/up in
    Q4_K or Q5_K too): each program decodes its region's types."""
    gen = torch.Generator().manual_seed(13)
    T, H, I, E, k = 3, 256, 256, 4, 2  # noqa: E741
    fmt = gguf_expert_format(("Q4_K", "Q5_K"), ("Q6_K", "Q4_K"), H, I, torch.float32)
    pool = ExpertPool.allocate(fmt, E, "cpu")
    for s, (gate_up, down) in enumerate([("Q4_K", "Q6_K"), ("Q5_K", "Q4_K"), ("Q4_K", "Q4_K"), ("Q5_K", "Q6_K")]):
        fmt.write(pool.buffer[s], random_gguf_expert(fmt, gen, gate_up, down))
    slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, k, gen)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H))
    for split in (1, 2):
        cfg = _with_split({"w13": {"BLOCK_N": 128, "BLOCK_K": 128}, "w2": {"BLOCK_K": 128}}, split)
        got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), backend="triton", config=cfg)
        assert rel_err(got, want) < 1e-5, split
