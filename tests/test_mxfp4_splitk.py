"""Split K in the MXFP4 expert kernels and the biased AWQ experts (gpt-oss), summed inside the launch by the
tile's last program, under TRITON_INTERPRET=1: splits 1/2/4/8 of both stages against the fp32 plain-torch
reference with and without biases; counters zero after every launch; bitwise the same whichever split arrives
last; staged masks = one pass bitwise; the decode defaults are the wave rule (gpt-oss-120b / -20b values)."""

from __future__ import annotations

import pytest
import torch

from moeflow import kernels
from moeflow.kernels import workspace
from moeflow.kernels.experts import configs, mxfp4
from moeflow.kernels.experts.biased import biased_expert_forward_reference
from tests.test_biased_kernels import biased_awq_pool
from tests.test_mxfp4 import mxfp4_pool, routing

SPLITS = (1, 2, 4, 8)
CPU = torch.device("cpu")
T, H, I, E, K = 3, 256, 96, 4, 2  # noqa: E741  (w13: K = 256, 8 tiles of 32; w2: K = 96, 3 tiles: splits past it)


def counters_zero() -> bool:
    return int(torch.count_nonzero(workspace.counters(1, CPU))) == 0


def cfg(split: int) -> dict:  # BLOCK_N 64: I = 96 is 1.5 w13 tiles (rows clamped), H = 256 four w2 tiles
    stage = {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": split}
    return {"BLOCK_M": 4, "w13": stage, "w2": stage}


def setup(bias: bool, seed: int = 0, activation: str = "clamped_swiglu"):
    gen = torch.Generator().manual_seed(seed)
    pool = mxfp4_pool(H, I, E, gen, activation, bias)
    ids, w = routing(T, E, K, gen)
    return pool, ids, w, torch.randn(T, H, generator=gen), torch.arange(E, dtype=torch.int32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("bias", [False, True])
def test_mxfp4_splits_match_the_fp32_reference(bias, monkeypatch):
    pool, ids, w, x, slots = setup(bias)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * K, H))
    launched, gemm = [], mxfp4.mxfp4_gemm
    monkeypatch.setattr(mxfp4, "mxfp4_gemm",
                        lambda *a, **kw: launched.append(kw["config"]["SPLIT_K"]) or gemm(*a, **kw))
    for split in SPLITS:
        got = kernels.expert_forward(x, ids, w, pool, slots, torch.full((T * K, H), float("nan")), backend="triton",
                                     config=cfg(split))
        assert launched[-2:] == [split, split]  # the custom op carried SPLIT_K to both stages
        assert relative_error(got, want) < 1e-5, split  # as test_mxfp4: exact weights, fp32 sums in another order
        assert counters_zero(), split  # the reducing program reset its tile's counter: a replay needs no memset


def test_mxfp4_fixup_is_deterministic_whoever_arrives_last(monkeypatch):
    """A launch whose split programs run in reverse order (split 0 arrives last and reduces) gives the same bits:
    the sum runs in split order, not arrival order; staged masks give one pass's bits with splits too."""
    pool, ids, w, x, slots = setup(True, seed=2)

    def run(mask=None, out=None):
        out = torch.zeros(T * K, H) if out is None else out
        return mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, out, mask, config=cfg(4))

    first = run()
    assert torch.equal(first, run())
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda a, b, c: forward(a, builder.grid_dim[1] - 1 - b, c))
    reversed_order = run()
    monkeypatch.undo()
    assert torch.equal(first, reversed_order) and counters_zero()
    staged = torch.zeros(T * K, H)
    half = torch.arange(E) % 2 == 0
    for mask in (half, ~half):
        run(mask, staged)
    assert torch.equal(staged, first) and counters_zero()


def test_mxfp4_stale_counters_would_show():
    """The counters decide who reduces: one left non-zero makes the first arriver reduce too early."""
    pool, ids, w, x, slots = setup(False, seed=3)
    good = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.zeros(T * K, H), config=cfg(2))
    # other inputs through the same (reused) partials buffer: a too-early reducer must not find good's partials
    mxfp4.mxfp4_expert_forward(x + 1.0, ids, w, pool, slots, torch.zeros(T * K, H), config=cfg(2))
    workspace.counters(1, CPU)[:16] = 1
    try:
        bad = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.zeros(T * K, H), config=cfg(2))
    finally:
        workspace.counters(1, CPU).zero_()
    assert not torch.equal(good, bad)


@pytest.mark.parametrize("bias", [False, True])
def test_biased_awq_splits_match_the_fp32_reference(bias):
    gen = torch.Generator().manual_seed(7)
    pool, _ = biased_awq_pool(H, I, 32, E, gen)
    if not bias:
        pool.tensors["w13_bias"].zero_()
        pool.tensors["w2_bias"].zero_()
    ids, w = routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen)
    slots = torch.arange(E, dtype=torch.int32)
    want = biased_expert_forward_reference(x, ids, w, pool, slots, torch.zeros(T * K, H))
    for split in SPLITS:
        stage = {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": split}
        got = kernels.expert_forward(x, ids, w, pool, slots, torch.full((T * K, H), float("nan")), backend="triton",
                                     config={"BLOCK_M": 4, "w13": stage, "w2": stage})
        assert relative_error(got, want) < 1e-5, split
        assert counters_zero(), split


def test_decode_splits_are_the_wave_rule():
    """MXFP4 decode tile: 5 programs per SM (benchmarks/results/sass/mxfp4-splitk.json), 660 slots on 132 SMs.
    gpt-oss-120b T = 1: w13 has 4 x 45 = 180 programs (27 % of a wave), w2 4 x 23 = 92: split 8 / 4; both models
    agree while T k <= 32 experts; T = 16: 120b's 64 blocks need w13 whole, 20b's 32 blocks split 2. The biased
    AWQ path (3 per SM) splits w13 by 2 at T = 1. Prefill never splits."""
    want = {1: (8, 4), 2: (8, 8), 4: (4, 8), 8: (2, 4)}
    for E_, last in ((128, (1, 2)), (32, (2, 4))):
        got = {t: mxfp4.stage_configs(t, E_, 4, 2880, 2880) for t in (1, 2, 4, 8, 16, 64)}
        assert {t: (c["w13"]["SPLIT_K"], c["w2"]["SPLIT_K"]) for t, c in got.items()} == {
            **want, 16: last, 64: (1, 1)}, E_
    assert round(configs.wave_efficiency(180 * 8, mxfp4.DECODE_PROGRAMS_PER_SM), 2) == 0.73
    assert mxfp4.stage_configs(1, 128, 4, 2880, 2880, {"w13": {"SPLIT_K": 1}})["w13"]["SPLIT_K"] == 1
    awq = configs.default_config("moe", 1, 128, 4, 2880, 2880, 32)
    assert (awq["w13"]["SPLIT_K"], awq["w2"]["SPLIT_K"]) == (2, 4)
