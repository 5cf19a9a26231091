"""The expert GEMM's split-K fixup (the last program of a tile sums the splits and runs the epilogue, one launch)
under TRITON_INTERPRET=1: splits 1/2/4/8 of w13 (both activations, with and without bias), w2 and the packed
linear against fp32 plain-torch references; counters zero after every launch (replay-safe); bitwise the same
run to run and whichever program arrives last; staged expert masks = one pass bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow import kernels
from moeflow.kernels import workspace
from moeflow.kernels.experts.gemm import expert_gemm
from moeflow.kernels.experts.reference import dequantize_kernel_layout, routing_plan_reference
from moeflow.quant.awq import dequantize, quantize_rtn
from tests.test_biased_kernels import biased_awq_pool
from tests.test_kernels import TOL, make_pool, make_routing

H, I, G, E, T, K = 256, 32, 32, 2, 3, 2  # noqa: E741  (w13: K = 256 is 8 tiles of 32, N = 64 one tile)
SPLITS = (1, 2, 4, 8)
CPU = torch.device("cpu")


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * float(ref.abs().max()))


def counters_zero() -> bool:
    return int(torch.count_nonzero(workspace.counters(1, CPU))) == 0


def setup(activation: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool, _ = biased_awq_pool(H, I, G, E, gen, activation=activation)
    ids, w = make_routing(T, K, E, seed=seed)
    x = torch.randn(T, H, generator=gen)
    return pool, ids, w.float(), x


def weights(pool, name: str, slot: int) -> torch.Tensor:
    """fp32 [N, K] of one slot's ``name`` (rows in kernel order: w13's gate / up interleaved)."""
    t = pool.tensors
    return dequantize_kernel_layout(t[f"{name}_qweight"][slot], t[f"{name}_qzeros"][slot],
                                    t[f"{name}_scales"][slot], G).float()


def w13_reference(pool, ids, x, bias: bool) -> torch.Tensor:
    """h fp32 [P, I]: x[pair // k] @ W13^T (+ bias), the format's activation of the interleaved gate / up."""
    pairs = ids.reshape(-1).long()
    h = torch.stack([x[p // K] @ weights(pool, "w13", int(e)).T for p, e in enumerate(pairs)])
    if bias:
        h = h + pool.tensors["w13_bias"][pairs].float()
    gate, up = h[:, 0::2], h[:, 1::2]
    if pool.fmt.activation == "silu":
        return F.silu(gate) * up
    limit, alpha = pool.fmt.swiglu_limit, pool.fmt.swiglu_alpha
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def launch(mode: int, pool, ids, a, split: int, bias: bool, w=None, block_n: int = 64, ws=None) -> torch.Tensor:
    """One expert_gemm launch (MODE 0 w13 or MODE 1 w2) over the plan of ``ids`` with ``SPLIT_K = split``."""
    name = "w13" if mode == 0 else "w2"
    t = pool.tensors
    sorted_ids, eob, _ = routing_plan_reference(ids, E, 4)
    P = ids.numel()
    out = torch.full((P, I if mode == 0 else H), float("nan"))
    cfg = {"BLOCK_M": 4, "BLOCK_N": block_n, "BLOCK_K": 32, "SPLIT_K": split}
    act = dict(activation=pool.fmt.activation, alpha=pool.fmt.swiglu_alpha, limit=pool.fmt.swiglu_limit)
    expert_gemm(mode, a, (t[f"{name}_qweight"], t[f"{name}_qzeros"], t[f"{name}_scales"]), out, sorted_ids, eob,
                torch.arange(E, dtype=torch.int32), None, None if w is None else w.reshape(-1), P,
                K if mode == 0 else 1, G, cfg, bias=t[f"{name}_bias"] if bias else None, ws=ws,
                **(act if mode == 0 else {}))
    return out


@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_w13_splits_match_the_fp32_reference(activation, bias):
    pool, ids, _, x = setup(activation)
    ref = w13_reference(pool, ids, x, bias)
    for split in SPLITS:
        got = launch(0, pool, ids, x, split, bias)
        close(got, ref)
        assert counters_zero(), split  # the reducing program reset its tile's counter: a replay needs no memset


def test_w2_splits_match_the_fp32_reference():
    pool, ids, w, _ = setup("silu", seed=1)
    h = torch.randn(ids.numel(), I, generator=torch.Generator().manual_seed(5))
    pairs = ids.reshape(-1).long()
    for bias in (False, True):
        y = torch.stack([h[p] @ weights(pool, "w2", int(e)).T for p, e in enumerate(pairs)])
        ref = (y + (pool.tensors["w2_bias"][pairs].float() if bias else 0)) * w.reshape(-1, 1)
        for split in SPLITS:
            close(launch(1, pool, ids, h, split, bias, w=w, block_n=128), ref)
            assert counters_zero(), (bias, split)


def test_fixup_is_deterministic_whoever_arrives_last(monkeypatch):
    """Two launches give the same bits, and so does a launch whose split programs run in reverse order (split 0
    arrives last and reduces): the sum runs in split order, not arrival order."""
    pool, ids, _, x = setup("clamped_swiglu", seed=2)
    first = launch(0, pool, ids, x, 4, True)
    assert torch.equal(first, launch(0, pool, ids, x, 4, True))
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: forward(x, builder.grid_dim[1] - 1 - y, z))
    reversed_order = launch(0, pool, ids, x, 4, True)
    monkeypatch.undo()
    assert torch.equal(first, reversed_order)
    assert counters_zero()


def test_stale_counters_would_show():
    """The counters are what decides who reduces: a counter left non-zero (a launch without the reset) makes the
    first arriver reduce before the other splits are stored, so the output changes."""
    pool, ids, _, x = setup("silu", seed=3)
    good = launch(0, pool, ids, x, 2, False)
    workspace.counters(1, CPU)[:8] = 1
    try:  # partials poisoned with NaN: a too-early reducer must not find good's partials left in reused memory
        bad = launch(0, pool, ids, x, 2, False, ws=torch.full((2, ids.numel(), 2 * I), float("nan")))
    finally:
        workspace.counters(1, CPU).zero_()
    assert not torch.equal(good.nan_to_num(), bad.nan_to_num())


@pytest.mark.parametrize("split", SPLITS)
def test_packed_linear_splits_in_one_launch(split):
    gen = torch.Generator().manual_seed(split)
    q = quantize_rtn(torch.randn(96, 256, generator=gen) / 16, G)
    packed = kernels.pack_awq_linear(q.qweight, q.qzeros, q.scales)
    x = torch.randn(3, 256, generator=gen)
    cfg = {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split}
    got = kernels.awq_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], G, "triton", config=cfg,
                             packed=True)
    close(got, x.double() @ dequantize(q.qweight, q.qzeros, q.scales.double(), G))
    assert counters_zero()


def test_staged_masks_equal_one_pass_with_split_w13_and_w2():
    pool = make_pool(128, 64, 4, 32, torch.float32, seed=4)
    ids, w = make_routing(5, 2, 4, seed=4)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    slots = torch.arange(4, dtype=torch.int32)
    cfg = {"BLOCK_M": 4, "w13": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 4},
           "w2": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}}
    one = torch.zeros(10, 128)
    kernels.expert_forward(x, ids, w, pool, slots, one, backend="triton", config=cfg)
    staged = torch.zeros(10, 128)
    first = torch.tensor([True, False, True, False])
    for mask in (first, ~first):
        kernels.expert_forward(x, ids, w, pool, slots, staged, mask, backend="triton", config=cfg)
    assert torch.equal(one, staged) and counters_zero()
    close(one, kernels.expert_forward(x, ids, w, pool, slots, torch.zeros(10, 128), backend="torch"))


def test_w13_decode_split_is_the_wave_rule():
    """Mixtral-8x7B at decode (132 SMs, 3 programs per SM): T = 1's 448 programs fill 1.13 waves (57 %), split 4
    fills 4.53 (91 %); T = 2 needs split 2; from T = 4 the 1792 programs are 4.53 waves already. ``--tune`` times
    w13 splits 1 / 2 / 4 / 8 at every decode tile."""
    from moeflow.kernels.experts import configs

    assert round(configs.wave_efficiency(448), 3) == 0.566 and round(configs.wave_efficiency(1792), 3) == 0.905
    splits = {T: configs.default_config("moe", T, 8, 2, 14336, 4096, 128)["w13"]["SPLIT_K"] for T in (1, 2, 4, 16)}
    assert splits == {1: 4, 2: 2, 4: 1, 16: 1}
    # w2 by the same rule (its partials summed in the combine): T >= 4 has 256 programs, 0.65 of a wave, unsplit
    w2 = {T: configs.default_config("moe", T, 8, 2, 14336, 4096, 128)["w2"]["SPLIT_K"] for T in (1, 2, 4, 16)}
    assert w2 == {1: 4, 2: 8, 4: 4, 16: 4}
    assert configs.default_config("moe", 64, 8, 2, 14336, 4096, 128)["w13"]["SPLIT_K"] == 1  # prefill: whole K
    cands = configs.tuning_candidates("decode", 128)
    for bm in (1, 16):
        assert {c["w13"]["SPLIT_K"] for c in cands if c["BLOCK_M"] == bm} == {1, 2, 4, 8}
