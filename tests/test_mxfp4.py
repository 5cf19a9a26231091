"""MXFP4 experts: the exact dequantization reference, the pool's K-panel layout, and the grouped Triton kernels
(under TRITON_INTERPRET=1) against the plain-torch reference on odd shapes, with biases, both activations and
staged expert masks, and bitwise the same from the panel layout as from the row-major one read through strides."""

from __future__ import annotations

import pytest
import torch

from moeflow import kernels
from moeflow.kernels.experts.biased import biased_expert_forward_reference
from moeflow.kernels.experts.mxfp4_reference import (
    check_mxfp4,
    dequantize_mxfp4,
    from_kernel_layout,
    quantize_mxfp4,
    to_kernel_layout,
)
from moeflow.kernels.formats import biased_expert_format
from moeflow.kernels.pool import ExpertPool


def random_mxfp4(shape, gen, lo=110, hi=135):
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers_bitwise():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4((3, 10, 4), gen, lo=90, hi=160)  # [E, N, K/32]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N] (x @ W orientation)
    got = dequantize_mxfp4(blocks, scales)  # [E, N, K]
    assert torch.equal(got.transpose(1, 2), want)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), got)  # exact in bf16 too


def test_quantize_round_trips_representable_values():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4((6, 2), gen)
    w = dequantize_mxfp4(blocks, scales)
    b2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b2, s2), w)
    x = torch.randn(8, 64, generator=gen)
    err = (dequantize_mxfp4(*quantize_mxfp4(x)) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert float(err.max()) <= 0.25 / 1.0 + 1e-6  # half an e2m1 step at the top of the block's range


def test_kernel_layout_is_an_exact_permutation_of_the_published_bytes():
    gen = torch.Generator().manual_seed(2)
    blocks, scales = random_mxfp4((6, 3), gen)
    kernel = to_kernel_layout(blocks)
    assert torch.equal(from_kernel_layout(kernel), blocks) and not torch.equal(kernel, blocks)
    # per word, the bits move but their count does not (a permutation, not a re-encoding)
    ones = lambda t: sum(((t.long() >> b) & 1).sum() for b in range(8))  # noqa: E731
    assert ones(kernel) == ones(blocks)
    fmt = biased_expert_format(64, 32, "mxfp4", torch.bfloat16, 32)
    region = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    (b13, s13), (b2, s2) = random_mxfp4((64, 2), gen), random_mxfp4((64, 1), gen)
    bias = torch.randn(128, generator=gen).bfloat16()
    tensors = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
               "w13_bias": bias[:64], "w2_bias": bias[64:]}
    fmt.write(region, tensors)
    back = fmt.loader_tensors(region)
    assert all(torch.equal(back[name], t) for name, t in tensors.items())


@pytest.mark.parametrize("H, I, panels", [(64, 32, (64, 32)), (2880, 96, (64, 32)), (96, 128, (32, 64))])
def test_region_stores_k_panels_and_loader_tensors_invert_write(H, I, panels):  # noqa: E741
    from moeflow.kernels.experts.mxfp4_reference import from_panels, to_panels

    fmt = biased_expert_format(H, I, "mxfp4", torch.bfloat16, 32)
    assert fmt.panels == panels
    p13, p2 = panels
    assert fmt.spec("w13_blocks").shape == (H // p13, 2 * I, p13 // 32, 16)
    assert fmt.spec("w2_scales").shape == (I // p2, H, p2 // 32)
    loader = fmt.loader_shapes()
    assert loader["w13_blocks"] == (2 * I, H // 32, 16) and loader["w2_scales"] == (H, I // 32)
    gen = torch.Generator().manual_seed(H + I)
    (b13, s13), (b2, s2) = random_mxfp4((2 * I, H // 32), gen), random_mxfp4((H, I // 32), gen)
    bias = torch.randn(2 * I + H, generator=gen).bfloat16()
    tensors = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
               "w13_bias": bias[: 2 * I], "w2_bias": bias[2 * I:]}
    pool = ExpertPool.allocate(fmt, 2, "cpu")
    fmt.write(pool.buffer[1], tensors)
    back = fmt.loader_tensors(pool.buffer[1])
    assert all(torch.equal(back[name], t) and back[name].is_contiguous() for name, t in tensors.items())
    # row n's k block g sits in panel g // (P/32), at place g % (P/32) of that panel's row n
    t = pool.tensors
    n, g = 2 * I - 3, H // 32 - 1
    assert torch.equal(t["w13_scales"][1, g // (p13 // 32), n, g % (p13 // 32)], s13[n, g])
    assert torch.equal(from_kernel_layout(t["w13_blocks"][1, g // (p13 // 32), n, g % (p13 // 32)]), b13[n, g])
    # a tile of rows in one panel is one contiguous byte range
    assert t["w2_blocks"][1, 0, 8:24].is_contiguous() and t["w2_scales"][1, -1, 8:24].is_contiguous()
    assert torch.equal(from_panels(to_panels(b2, p2)), b2) and torch.equal(from_panels(to_panels(s2, p2)), s2)


def test_blocks_that_disagree_with_scales_are_refused():
    with pytest.raises(ValueError, match="w2: MXFP4 blocks .* disagree with scales"):
        check_mxfp4(torch.zeros(4, 3, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "w2")


def mxfp4_pool(H, I, n_slots, gen, activation="clamped_swiglu", bias=True, dtype=torch.float32):  # noqa: E741
    fmt = biased_expert_format(H, I, "mxfp4", dtype, 32, activation=activation, bias=bias)
    pool = ExpertPool.allocate(fmt, n_slots, "cpu")
    for s in range(n_slots):
        w13 = random_mxfp4((2 * I, H // 32), gen, 120, 126)
        w2 = random_mxfp4((H, I // 32), gen, 118, 124)
        tensors = {"w13_blocks": w13[0], "w13_scales": w13[1], "w2_blocks": w2[0], "w2_scales": w2[1]}
        if bias:
            tensors["w13_bias"] = torch.randn(2 * I, generator=gen)
            tensors["w2_bias"] = torch.randn(H, generator=gen)
        fmt.write(pool.buffer[s], tensors)
    return pool


def routing(T, E, k, gen, one_expert=False):
    if one_expert:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        ids[:, 0] = E - 1
        ids = torch.stack([torch.cat([r[:1], r[1:][r[1:] != E - 1][: k - 1]]) for r in ids]) if k < E else ids
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    return ids.to(torch.int32), weights


CASES = [  # (T, H, I, E, k, activation, bias)
    (1, 64, 96, 5, 2, "clamped_swiglu", True),  # decode: GEMV path
    (7, 96, 160, 7, 3, "clamped_swiglu", True),  # odd T, K = 3 blocks, I = 5 blocks, prime E
    (33, 32, 64, 3, 3, "silu", False),  # k = E, tl.dot path (33 rows)
    (40, 64, 32, 4, 1, "clamped_swiglu", True),  # k = 1, empty experts likely
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}" for c in CASES])
def test_triton_matches_reference(case):
    T, H, I, E, k, act, bias = case  # noqa: E741
    gen = torch.Generator().manual_seed(T * 31 + E)
    pool = mxfp4_pool(H, I, E + 2, gen, act, bias)
    slots = torch.randperm(E + 2, generator=gen)[:E].to(torch.int32)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, k, gen)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H))
    got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), backend="triton")
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    # staged: the experts in two masks give bitwise the rows of one pass
    one_pass = kernels.expert_forward(x, ids, w, pool, slots, torch.full((T * k, H), 7.0), backend="triton")
    staged = torch.full((T * k, H), 7.0)
    first = torch.zeros(E, dtype=torch.bool)
    first[::2] = True
    for mask in (first, ~first):
        kernels.expert_forward(x, ids, w, pool, slots, staged, mask, backend="triton")
    assert torch.equal(staged, one_pass)
    half = torch.full((T * k, H), 7.0)
    kernels.expert_forward(x, ids, w, pool, slots, half, first, backend="triton")
    untouched = ~first[ids.reshape(-1).long()]
    assert torch.equal(half[untouched], torch.full_like(half[untouched], 7.0))


@pytest.mark.parametrize("tokens, config", [
    (40, None),  # 80 pairs: 32-row plan blocks (the default)
    (1, None),  # decode: one token, 16 MMA columns
    (3, {"BLOCK_M": 2, "w13": {"BLOCK_N": 16, "BLOCK_K": 32}, "w2": {"BLOCK_N": 32}}),  # small tiles, clamped rows
    (40, {"BLOCK_M": 16, "w13": {"BLOCK_N": 128}, "w2": {"BLOCK_N": 128, "BLOCK_K": 128}}),  # tiles past N
])
def test_triton_bf16_and_all_tokens_on_one_expert(tokens, config):
    gen = torch.Generator().manual_seed(5)
    T, H, I, E, k = tokens, 96, 64, 4, 2  # noqa: E741
    pool = mxfp4_pool(H, I, E, gen, dtype=torch.bfloat16)
    slots = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.tensor([3, j % 3]) for j in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=torch.bfloat16))
    got = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=torch.bfloat16),
                                 backend="triton", config=config)
    # the same exact weights; h and the outputs in bf16, and the interpreter truncates fp32 -> bf16 stores instead
    # of rounding (measured: <= 1.1e-2 of the largest output): a few bf16 ulps
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2
    one_expert = kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H, dtype=torch.bfloat16),
                                        torch.arange(E) == 3, backend="triton", config=config)
    assert torch.equal(one_expert[0::2], got[0::2])  # staged: expert 3's rows alone, bitwise


@pytest.mark.parametrize("config, view_panel", [
    (None, None),  # default tiles: BLOCK_K = the panel (64 at K = 128 and 192)
    ({"w13": {"BLOCK_K": 128, "SPLIT_K": 2}, "w2": {"BLOCK_K": 32, "SPLIT_K": 2}}, None),  # 2 panels / half a panel
    ({"BLOCK_M": 16, "w13": {"BLOCK_N": 32, "BLOCK_K": 32}}, 128),  # the row-major view as whole-row panels (w13)
])
def test_panel_and_row_major_layouts_give_bitwise_the_same_output(config, view_panel):
    from moeflow.kernels.experts import mxfp4
    from moeflow.kernels.experts.mxfp4_reference import row_major_as_panels

    gen = torch.Generator().manual_seed(11)
    T, H, I, E, k = 6, 128, 192, 4, 2  # noqa: E741  (w13: K = 128, 2 panels; w2: K = 192, 3 panels)
    pool = mxfp4_pool(H, I, E, gen)
    row_major = mxfp4.row_major_copy(pool)
    # the copy is the published order: rows K/2 bytes apart, a row's panels P/2 bytes apart
    assert row_major["w2_blocks"].shape == pool.tensors["w2_blocks"].shape == (E, I // 64, H, 2, 16)
    assert row_major["w2_blocks"].stride()[1:] == (32, I // 2, 16, 1)
    assert row_major["w13_scales"].stride()[1:] == (2, H // 32, 1)
    assert pool.tensors["w13_blocks"].stride()[1:] == (2 * I * 32, 32, 16, 1)
    loader = pool.fmt.loader_tensors(pool.buffer[2])
    assert torch.equal(row_major["w13_scales"][2].transpose(0, 1).reshape(2 * I, H // 32), loader["w13_scales"])
    if view_panel:  # the same memory seen with one panel per row
        for name in ("w13_blocks", "w13_scales"):
            t = row_major[name]
            row_major[name] = row_major_as_panels(t.transpose(1, 2).flatten(2, 3), view_panel)
        assert row_major["w13_blocks"].shape[1] == 1
    slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, k, gen)
    panels = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), config=config)
    rows = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.zeros(T * k, H), config=config, weights=row_major)
    assert torch.equal(panels, rows)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * k, H))
    assert float((panels - want).abs().max() / want.abs().max()) < 1e-5
