"""The simulator prices MTP speculation (moeflow/sim/speculation.py): recorded passes of a tiny DeepSeek-V3 with an
MTP layer, replayed through the real scheduler on virtual time. lru's expert loads equal the real engine's (plain
and speculative); drafts forced wrong move more bytes per generated token than plain decoding; drafts forced right
at k = 1 make every verify pass yield 2 tokens (and fewer passes than plain). ~15 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from mtp_helpers import make_mtp_checkpoint
from test_mtp import SHAPE

import moeflow.engine.mtp as mtp_engine
from moeflow import MoEModel, OffloadConfig
from moeflow.sim.profile import get_profile
from moeflow.sim.simulator import SimulationError, simulate
from moeflow.sim.speculation import any_shape, price, record_passes
from moeflow.trace import DECODE

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12
PROFILE = get_profile("pcie4-24gb")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, _ = make_mtp_checkpoint(tmp_path_factory.mktemp("sim_spec"), seed=5, **dict(SHAPE))
    prompts = [torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(1))]
    plain = record_passes(MoEModel.from_pretrained(path), prompts, NEW)
    return path, prompts, plain


def forced(monkeypatch, right: bool, truth: torch.Tensor) -> None:
    """Drafts replaced by the plain greedy token (``right``) or by another token, after the real MTP passes ran."""
    real = mtp_engine.propose

    def propose(drafter, mtp_in, k, n, pad, history, device, choose):
        draft, qs = real(drafter, mtp_in, k, n, pad, history, device, choose)
        want = [int(truth[0, n + j]) for j in range(len(draft))]
        return (want if right else [(w + 1) % 97 for w in want]), qs

    monkeypatch.setattr(mtp_engine, "propose", propose)


@pytest.mark.parametrize("slots", [3, 6])
def test_lru_loads_equal_the_real_engine(tiny, slots):
    path, prompts, plain = tiny
    spec = record_passes(MoEModel.from_pretrained(path, mtp=True), prompts, NEW, 1)
    assert torch.equal(spec.outputs[0], plain.outputs[0])
    assert spec.trace.num_layers == plain.trace.num_layers + 1
    for run, mtp in ((plain, False), (spec, True)):
        model = MoEModel.from_pretrained(path, mtp=mtp, offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        model.generate(prompts[0][None], max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                       num_speculative_tokens=1 if mtp else None, mtp_prefetch=None)
        real_loads = model.stats.decode.bytes_h2d / model.experts.fmt.nbytes
        model.experts.close()
        res = simulate(run.trace, "lru", slots, any_shape(PROFILE), passes=run.passes, timeline=False)
        assert res.decode_bytes_h2d / PROFILE.expert_bytes == pytest.approx(real_loads, abs=1e-6)
        assert res.decode_generated_tokens == NEW - 1


def test_acceptance_zero_costs_more_than_plain(tiny, monkeypatch):
    path, prompts, plain = tiny
    forced(monkeypatch, False, plain.outputs[0])
    spec = record_passes(MoEModel.from_pretrained(path, mtp=True), prompts, NEW, 1)
    assert spec.accepted == 0 and spec.drafted > 0
    assert torch.equal(spec.outputs[0], plain.outputs[0])
    for slots in (3, 6):
        base, sp = price(plain, "lru", slots, PROFILE), price(spec, "lru", slots, PROFILE)
        assert sp["decode_tokens"] == base["decode_tokens"] == NEW - 1
        assert sp["bytes_per_token"] > base["bytes_per_token"]
        assert sp["time_per_token_s"] > base["time_per_token_s"]


def test_acceptance_one_yields_two_tokens_per_verify_pass(tiny, monkeypatch):
    path, prompts, plain = tiny
    forced(monkeypatch, True, plain.outputs[0])
    spec = record_passes(MoEModel.from_pretrained(path, mtp=True), prompts, NEW, 1)
    assert spec.acceptance == 1.0
    verify = [p for p in spec.passes[0] if p.phase == DECODE and p.layers != (spec.trace.num_layers - 1,)]
    # every round drafts one token and keeps it, but the last, which has room for no draft (NEW - 1 is odd)
    assert [p.yields for p in verify] == [2] * ((NEW - 1) // 2) + [1] * ((NEW - 1) % 2)
    res = price(spec, "lru", 6, PROFILE)
    base = price(plain, "lru", 6, PROFILE)
    assert res["decode_tokens"] == NEW - 1 and base["decode_passes"] == NEW - 1
    free = price(spec, "lru", 6, PROFILE, mtp_passes=False)  # the drafts as if free: only the verify passes
    assert free["decode_passes"] == len(verify) and free["decode_tokens"] == NEW - 1
    assert free["bytes_per_token"] < res["bytes_per_token"]
    assert sum(p.rows.stop - p.rows.start for p in verify) == 2 * ((NEW - 1) // 2) + (NEW - 1) % 2


def test_oracle_refuses_recorded_passes(tiny):
    _, _, plain = tiny
    with pytest.raises(SimulationError, match="passes="):
        simulate(plain.trace, "oracle", 3, any_shape(PROFILE), passes=plain.passes)


def test_draft_prefetch_is_recorded_and_replayed(tiny):
    """generate(mtp_prefetch="mtp") asks the backend for each verify pass's predicted experts before the pass: the
    requests ride with the recorded verify passes (and no other pass), and the simulator queues them (lru has no
    predictor of its own: every prefetch it counts is one of them). The real engine counts the same requests: under
    lru every prefetch the cache saw is a draft prefetch."""
    path, prompts, plain = tiny
    spec = record_passes(MoEModel.from_pretrained(path, mtp=True), prompts, NEW, 1, mtp_prefetch="mtp")
    assert torch.equal(spec.outputs[0], plain.outputs[0])
    verify = [p for p in spec.passes[0] if p.phase == DECODE and p.yields > 0]
    assert verify and all(p.prefetch for p in verify)
    assert not any(p.prefetch for p in spec.passes[0] if p not in verify)
    assert all(layer < spec.main_layers for p in verify for layer, _ in p.prefetch)
    res = simulate(spec.trace, "lru", 3, any_shape(PROFILE), passes=spec.passes, timeline=False)
    bare = simulate(spec.trace, "lru", 3, any_shape(PROFILE), passes=without_prefetch(spec.passes), timeline=False)
    assert res.prefetches > 0 and bare.prefetches == 0
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy="lru", gpu_expert_slots=3))
    try:
        out = model.generate(prompts[0][None], max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                             num_speculative_tokens=1, mtp_prefetch="mtp")
    finally:
        model.experts.close()
    assert torch.equal(out, plain.outputs[0])
    dp = model.stats.draft_prefetch
    assert dp.queued == model.stats.decode.prefetches > 0
    assert dp.predicted == sum(len(e) for p in verify for _, e in p.prefetch)
    assert 0 < dp.predicted_used <= min(dp.predicted, dp.needed) and dp.queued_used <= dp.queued


def without_prefetch(passes):
    from dataclasses import replace

    return [[replace(p, prefetch=()) for p in steps] for steps in passes]
