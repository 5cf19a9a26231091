"""ExpertFlow's dual-batch inference pipeline (offload/policies/expertflow/pipeline.py, the policy's decode
strategy): exact tokens, the overlap on a virtual clock, bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint
from test_expertflow import padded_batch  # n left-padded prompts of random lengths
from tiny_families import expertflow_predictor_file

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.side_lane import InlineLane, VirtualLane
from moeflow.errors import InputError, SchedulingError
from moeflow.offload.policies.expertflow.pipeline import DualBatchPipeline
from moeflow.sim.engine import SimClock

LAYERS, EXPERTS = 3, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("db"), seed=5, num_local_experts=EXPERTS,
                                num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def predictor_file(ckpt, tmp_path_factory):
    return expertflow_predictor_file(ckpt, tmp_path_factory.mktemp("dbp"))


def expertflow(ckpt, predictor_file, slots: int, transport: str = "sync", seed: int = 0):
    return MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
        policy="expertflow", gpu_expert_slots=slots, predictor_path=str(predictor_file), transport=transport,
        random_delay_ms=0.3, seed=seed))


# ---------------------------------------------------------------------------------------------- invariant
def test_exact_tokens_every_slot_count(ckpt, predictor_file):
    """Every slot count 2..24 (sync and random-delay transports on alternate counts), 6 left-padded prompts,
    micro-batches of 1, 2 and 3 in turn: the pipeline's tokens are the resident model's."""
    ids, mask = padded_batch(6, seed=1)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=4,
                                                             eos_token_id=[])
    for slots in range(2, LAYERS * EXPERTS + 1):
        transport = "sync" if slots % 2 else "random-delay"
        model = expertflow(ckpt, predictor_file, slots, transport, seed=slots)
        m = (1, 2, 3)[slots % 3]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], micro_batch_size=m)
        assert torch.equal(out, ref), (slots, transport, m)
        st = model.pipeline_stats
        assert st is not None and st.rounds == 3 and st.passes == 3 * -(-6 // m), (slots, st)
        assert st.fresh_rows + st.stale_rows == 3 * 6  # every row starts every round's pass once
        model.experts.cache.check()
        model.close()


@pytest.mark.parametrize(("batch", "transport"), [(2, "sync"), (5, "random-delay"), (9, "sync"), (16, "random-delay"),
                                                  (16, "sync")])
def test_exact_tokens_batches_and_micro_batch_sizes(ckpt, predictor_file, transport, batch):
    """Batches of 2..16 prompts of different lengths, micro-batches of 1, 2 and about half the batch (16: 2, 5
    and 8), at a small and a middle slot count: tokens equal the resident model's (and, at the middle count,
    the sequential micro-batch loop's)."""
    ids, mask = padded_batch(batch, seed=batch)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=3,
                                                             eos_token_id=[])
    sizes = {2, 5, 8} if batch == 16 else {1, 2, max(1, batch // 2)}
    for slots in (3, 12):
        model = expertflow(ckpt, predictor_file, slots, transport, seed=batch)
        for m in sorted(sizes):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[], micro_batch_size=m)
            assert torch.equal(out, ref), (slots, m)
            assert model.pipeline_stats is not None
            if slots == 12:
                off = model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[],
                                     micro_batch_size=m, dual_batch=False)
                assert torch.equal(off, ref) and model.pipeline_stats is None, (slots, m)
        model.experts.cache.check()
        model.close()


def test_eos_and_inline_lane_same_tokens(ckpt, predictor_file, monkeypatch):
    """Sequences finishing early are padded as in the whole-batch loop; the inline lane (no overlap) gives the
    same tokens as the worker thread."""
    ids, mask = padded_batch(5, seed=7)
    ref_model = MoEOffloadedMixtral.from_pretrained(ckpt)
    free = ref_model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 1])  # row 0 stops after its second token
    ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    model = expertflow(ckpt, predictor_file, 5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0,
                         micro_batch_size=2)
    assert torch.equal(out, ref)
    import moeflow.engine.generate as gen_mod

    monkeypatch.setattr(gen_mod, "ThreadLane", lambda device: InlineLane())
    inline = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0,
                            micro_batch_size=2)
    assert torch.equal(inline, ref)
    assert model.pipeline_stats.exposed_s >= model.pipeline_stats.lane_busy_s > 0  # inline: nothing hidden


# ---------------------------------------------------------------------------------------------- the overlap
def virtual_rounds(model, ids, mask, m: int, decode_s: float, predict_s: float, schedule_s: float,
                   overlaps: bool, monkeypatch) -> list[float]:
    """Virtual seconds of each decode round: every decode pass costs ``decode_s`` on a SimClock, each prediction
    job ``predict_s`` and each scheduling ``schedule_s`` on a VirtualLane (overlapping the passes or not)."""
    clock = SimClock()
    runner = model._runner
    real_pass = runner.forward_pass

    def timed_pass(*args, **kwargs):
        out = real_pass(*args, **kwargs)
        if args[5] == "decode":
            clock.advance_to(clock.now + decode_s)
        return out

    monkeypatch.setattr(runner, "forward_pass", timed_pass)
    costs = {"_predict": predict_s, "_schedule": schedule_s}
    lane = VirtualLane(clock, lambda fn: costs[fn.__name__], overlaps=overlaps)
    rounds: list[float] = []
    real_round = DualBatchPipeline.round

    def timed_round(self, *args, **kwargs):
        t0 = clock.now
        out = real_round(self, *args, **kwargs)
        rounds.append(clock.now - t0)
        return out

    monkeypatch.setattr(DualBatchPipeline, "round", timed_round)
    from moeflow.engine.generate import generate as run_generate

    gen = model.generation_config.override(max_new_tokens=6, eos_token_id=[])
    run_generate(runner, gen, ids, mask != 0, micro_batch_size=m, dual_batch=True, lane=lane)
    monkeypatch.undo()
    return rounds[1:]  # the first round waits for the first predictions (nothing ran before it)


@pytest.mark.parametrize("m", [2, 1])
def test_injected_predictor_delay_is_hidden(ckpt, predictor_file, monkeypatch, m):
    """Decode passes of 1 virtual ms, prediction + scheduling slowed to a share of a pass: with the pipeline a
    round stays within 10 % of the no-predictor round; run inline it costs their sum."""
    ids, mask = padded_batch(4, seed=3)
    model = expertflow(ckpt, predictor_file, 8)
    n = -(-4 // m)  # passes per round
    d = 1e-3
    base = virtual_rounds(model, ids, mask, m, d, 0.0, 0.0, True, monkeypatch)
    assert base == pytest.approx([n * d] * len(base))
    for share in (0.5, 0.9):
        predict, schedule = share * d * 0.8, share * d * 0.2  # prediction + scheduling = share of a pass
        piped = virtual_rounds(model, ids, mask, m, d, predict, schedule, True, monkeypatch)
        assert max(piped) <= 1.10 * n * d, (share, piped)
        serial = virtual_rounds(model, ids, mask, m, d, predict, schedule, False, monkeypatch)
        assert min(serial) >= n * d + n * predict + schedule - 1e-12, (share, serial)
    # slower than a pass: the predictions set the pace, the round is about max(decode, predict + schedule)
    slow = virtual_rounds(model, ids, mask, m, d, 2 * d, 0.0, True, monkeypatch)
    assert n * 2 * d * 0.9 <= sum(slow) / len(slow) <= n * 2 * d * 1.1 + d, slow


def test_next_pass_experts_prefetched_during_the_pass(ckpt, predictor_file):
    """§4.1: with the pipeline, the next micro-batch's planned experts are prefetched during the current pass,
    so more of each pass's plan is resident when it starts than with the sequential loop."""
    ids, mask = padded_batch(8, seed=4)
    model = expertflow(ckpt, predictor_file, 12)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[], micro_batch_size=4)
    st = model.pipeline_stats
    assert st.next_pass_prefetches > 0
    assert 0 < st.resident_at_start <= st.planned_at_start


# ---------------------------------------------------------------------------------------------- token scheduler
def test_token_scheduler_runs_as_the_policy_asks(ckpt, predictor_file, monkeypatch):
    """ExpertFlow's token scheduler (§3.3) forms the micro-batches of generate's prefill and of every pipeline round
    the way the policy asks (``Mechanisms.keep_contiguous``): moeflow's variant by default, the paper's clustering
    with ``policy_options={"keep_contiguous": False}``; the tokens are the resident model's either way, and the
    plain loop (``dual_batch=False``) keeps moeflow's variant."""
    import moeflow.offload.policies.expertflow.runtime as plec

    ids, mask = padded_batch(6, seed=11)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=4,
                                                             eos_token_id=[])
    calls: list[tuple[bool, list[list[int]]]] = []
    real = plec.group_by_routing

    def spy(paths, size, **kw):
        groups = real(paths, size, **kw)
        calls.append((kw["keep_contiguous"], groups))
        return groups

    monkeypatch.setattr(plec, "group_by_routing", spy)
    differ = 0
    for options, want in ((None, True), ({"keep_contiguous": False}, False)):
        model = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=6, predictor_path=str(predictor_file), policy_options=options))
        calls.clear()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], micro_batch_size=2)
        assert torch.equal(out, ref), options
        # the prefill's grouping, its regrouping by observed paths, then one schedule per round after the first 3
        assert len(calls) == 2 + 3 and {k for k, _ in calls} == {want}, (options, calls)
        assert model.pipeline_stats.rounds == 3
        differ += sum(g != [list(range(i, i + 2)) for i in range(0, 6, 2)] for _, g in calls)
        calls.clear()
        off = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], micro_batch_size=2,
                             dual_batch=False)
        assert torch.equal(off, ref) and not calls, options  # the plain loop: the engine's own grouping
        model.close()
    assert differ > 0  # the scheduler did regroup (some grouping is not the contiguous split)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input(ckpt, predictor_file):
    ids, mask = padded_batch(4, seed=2)
    model = expertflow(ckpt, predictor_file, 6)
    for m in (0, 5, -1, 2.0):
        with pytest.raises(ValueError, match="micro_batch_size"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, micro_batch_size=m, dual_batch=True)
    with pytest.raises(InputError, match="micro_batch_size"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, dual_batch=True)
    lru = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(policy="lru", gpu_expert_slots=6))
    with pytest.raises(SchedulingError, match="routing-path predictor.*'lru'"):
        lru.generate(ids, attention_mask=mask, max_new_tokens=2, micro_batch_size=2, dual_batch=True)
    resident = MoEOffloadedMixtral.from_pretrained(ckpt)
    with pytest.raises(SchedulingError, match="routing-path predictor"):
        resident.generate(ids, attention_mask=mask, max_new_tokens=2, micro_batch_size=2, dual_batch=True)
    # the default picks the pipeline only where it can run
    out = lru.generate(ids, attention_mask=mask, max_new_tokens=2, micro_batch_size=2)
    assert out.shape == (4, ids.shape[1] + 2) and lru.pipeline_stats is None
