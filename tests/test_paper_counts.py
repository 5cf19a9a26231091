"""Pinned behaviour of the paper-or-variant switches (``Mechanisms``, ``OffloadConfig.policy_options``).

Like tests/test_policy_counts.py: synchronous transport (or the scripted one), hand-made traces, every expected
number derived in the comment beside it (warm start: slot i holds expert (i % L, i // L), loaded in slot order).
Each test runs the switch both ways, so a switch that stopped switching fails here.
"""

from __future__ import annotations

import pytest
import torch
from scripted_transport import ScriptedTransport
from test_policy_counts import backend_for, resident, speculation_trace, step
from test_scheduling_helpers import AWQ, DENSE, Synthetic

from moeflow.config import OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.offload import CopyEngine, SyncTransport
from moeflow.offload.chunks import chunk_ranges, linear_chunks
from moeflow.offload.copy_engine import PREFETCH_CHUNK_BYTES
from moeflow.offload.policies import POLICY_TABLE
from moeflow.offload.policies.spec import Mechanisms


@pytest.mark.parametrize("refresh", [False, True])
def test_prefetch_of_a_cached_expert_refreshes_its_recency(refresh):
    """ProMoE's LRU: predicting a cached expert touches it (refresh) or not (moeflow's variant)."""
    synth = Synthetic(DENSE, layers=1, experts=4, top_k=1, seed=2)
    backend, stats = backend_for(synth, policy="lru", gpu_expert_slots=2,
                                 policy_options={"refresh_on_prefetch": refresh})
    # warm start: 0 (tick 1), 1 (tick 2); the prediction of cached 0 moves it to tick 3 only with refresh
    backend.prefetch(0, [0], layer_now=0)
    assert stats.decode.prefetches == 0  # nothing moved either way
    # miss on 3: LRU evicts the oldest, 1 with refresh (0 is now newer), 0 without
    assert step(backend, stats, 0, [3]) == ({0, 3} if refresh else {1, 3})
    backend.close()


@pytest.mark.parametrize("refresh", [False, True])
def test_per_layer_lru_refresh(refresh):
    """The per-layer split (ProMoE, mixtral-offloading): a layer at its quota evicts its own least recent expert,
    from the per-layer order, which the refresh moves too."""
    synth = Synthetic(DENSE, layers=2, experts=4, top_k=1, seed=2)
    backend, stats = backend_for(synth, {"per_layer": True}, policy="lru", gpu_expert_slots=4,
                                 policy_options={"refresh_on_prefetch": refresh})
    assert backend.cache.layer_quota == 2
    # warm: (0,0) t1, (1,0) t2, (0,1) t3, (1,1) t4; the prediction of (0,0) moves it past (0,1) with refresh
    backend.prefetch(0, [0], layer_now=0)
    assert step(backend, stats, 0, [2]) == ({0, 2} if refresh else {1, 2})
    assert resident(backend, 1) == {0, 1}  # the other layer keeps its quota
    backend.close()


def test_linear_chunks_follow_the_matrices():
    """One chunk per linear layer: dense gate | up | down (w13 split at its middle), AWQ (gate+up) | down."""
    w13, w2 = DENSE.spec("w13"), DENSE.spec("w2")
    assert linear_chunks(DENSE) == [(0, w13.nbytes // 2), (w13.nbytes // 2, w2.offset), (w2.offset, DENSE.nbytes)]
    assert linear_chunks(AWQ) == [(0, AWQ.spec("w2_qweight").offset), (AWQ.spec("w2_qweight").offset, AWQ.nbytes)]


@pytest.mark.parametrize("chunks", ["pieces", "per-linear"])
def test_prefetch_chunking(chunks):
    """A predicted load is cut into the configured chunks; a needed load keeps ``copy_chunks`` equal ones; an
    early preemption drops the unissued chunks of a wrong guess (counted per chunk)."""
    synth = Synthetic(DENSE, layers=2, experts=4, top_k=1, seed=2)
    backend, _ = backend_for(synth, policy="lru", gpu_expert_slots=8, policy_options={"prefetch_chunks": chunks},
                             copy_chunks=2)
    # pieces: max(copy_chunks, ceil(size / 8 MiB)) equal ones; this expert is far below 8 MiB: copy_chunks = 2
    assert DENSE.nbytes < PREFETCH_CHUNK_BYTES
    want = linear_chunks(DENSE) if chunks == "per-linear" else chunk_ranges(DENSE.nbytes, 2)
    assert list(backend.engine.low_chunks) == want
    engine = CopyEngine(SyncTransport(), backend.host, backend.pool, chunks=2)
    engine.set_low_chunks(want)
    low = engine.submit(1, 2, 0, high=False)
    high = engine.submit(0, 3, 1, high=True)
    assert len(high.chunks) == 2 and len(low.chunks) == len(want)
    engine.pump(1)  # the needed load goes first (its two chunks in one batch); the guess has not moved
    assert high.issued and low.next_chunk == 0
    _, dropped = engine.preempt(1, needed=set())
    assert dropped == [low] and engine.cancelled_chunks == len(want)  # 3 per-linear chunks, else 2 pieces
    engine.close()
    backend.close()


def test_low_chunks_must_cover_the_region():
    synth = Synthetic(DENSE, layers=1, experts=2, top_k=1, seed=2)
    backend, _ = backend_for(synth, policy="lru", gpu_expert_slots=2)
    with pytest.raises(ValueError, match="not adjacent non-empty ranges covering"):
        backend.engine.set_low_chunks([(0, 256)])
    backend.close()


@pytest.mark.parametrize("ranked", [False, True])
def test_queue_priority_orders_the_predicted_loads(ranked):
    """FineMoE §4.5: with ``queue_priority`` a prediction's p / (l - l_now) (p = 1 for the router speculation)
    orders the low queue, the nearer layer first; without, arrival order."""
    synth = Synthetic(DENSE, layers=4, experts=4, top_k=1, seed=2)
    backend, stats = backend_for(synth, policy="mixtral-offloading", gpu_expert_slots=8,
                                 policy_options={"queue_priority": ranked})
    st = stats.current()
    backend.loads.prefetch_guesses(3, [3], 0, st)  # 3 layers ahead: priority 1/3
    backend.loads.prefetch_guesses(1, [3], 0, st)  # 1 layer ahead: 1
    backend.loads.prefetch_guesses(2, [3], 0, st)  # 2 layers ahead: 1/2
    pending = backend.engine.pending()
    assert [t.layer for t in pending] == ([1, 2, 3] if ranked else [3, 1, 2])
    assert [t.priority for t in pending] == ([1.0, 0.5, pytest.approx(1 / 3)] if ranked else [0.0] * 3)
    backend.close()


def test_finemoe_priority_is_p_over_distance():
    """FineMoE's runtime gives the searched p: guidance[l, e] / (l - l_now), l_now clipped below l."""
    from moeflow.offload.policies import FineMoERuntime
    from moeflow.offload.policies.finemoe.predictor import FineMoEPredictor
    from moeflow.offload.predictors.base import ModelShape

    pred = FineMoEPredictor(ModelShape(num_layers=4, num_experts=4, top_k=1, hidden_size=8), distance=2)
    pred.guidance[3] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rt = FineMoERuntime(pred)
    assert rt.queue_priority(3, 2, 1) == pytest.approx(0.3 / 2)
    assert rt.queue_priority(3, 3, 0) == pytest.approx(0.4 / 3)
    assert rt.queue_priority(3, 1, 5) == pytest.approx(0.2)  # a layer not ahead counts as the next


@pytest.mark.parametrize("in_prefill", [True, False])
def test_predictor_off_in_prefill(in_prefill):
    """DuoServe runs no predictor in prefill: the same prefill step prefetches layer 1's guess or nothing; decode
    predicts either way (speculation trace of test_policy_counts: input e_1 -> layer 1 needs {2, 3})."""
    synth = speculation_trace()
    backend, stats = backend_for(synth, policy="mixtral-offloading", gpu_expert_slots=4,
                                 policy_options={"predict_in_prefill": in_prefill})
    x = torch.zeros(1, synth.fmt.hidden_size)
    x[0, 1] = 1.0
    # warm: experts 0, 1 of both layers; 4, 5 miss and take (0,0), (1,0); the guess {2, 3} for layer 1 would
    # take the other two slots (4, 5 are pinned until computed)
    step(backend, stats, 0, [4, 5], phase="prefill", x=x)
    assert stats.prefill.prefetches == (2 if in_prefill else 0)
    step(backend, stats, 0, [4, 5], phase="decode", x=x)  # hits; the guess is resident only if prefill fetched it
    assert stats.decode.prefetches == (0 if in_prefill else 2)
    backend.close()


def test_goodpred_counts_late_prefetches_apart():
    """ProMoE's GoodPred = Accuracy x FetchRate. Synchronous copies land at once (FetchRate 1); a scripted "late"
    transport lands a prefetch only when its gate waits on it: a hit, but in flight (FetchRate 0, GoodPred 0)."""
    synth = speculation_trace()
    for transport, timely in ((None, True), (ScriptedTransport("late"), False)):
        backend, stats = synth.offloaded(transport="sync", transport_object=transport, policy="mixtral-offloading",
                                         gpu_expert_slots=4)
        for t in range(3):
            x0 = torch.zeros(1, synth.fmt.hidden_size)
            x0[0, t % 2] = 1.0
            step(backend, stats, 0, [4, 5], x=x0)
            step(backend, stats, 1, [0, 1] if t % 2 == 0 else [2, 3])
        backend.synchronize()
        d = stats.decode
        # as test_mixtral_offloading_speculates...: steps 1, 2 prefetch layer 1's pair (4 prefetches), all used
        assert (d.prefetches, d.useful_prefetches, d.prefetch_accuracy) == (4, 4, 1.0)
        assert d.timely_prefetches == (4 if timely else 0)
        assert d.inflight_hits == (0 if timely else 4)  # counted apart from the hits with bytes in place
        assert (d.fetch_rate, d.goodpred) == ((1.0, 1.0) if timely else (0.0, 0.0))
        assert d.ready_hit_rate == pytest.approx((d.hits - d.inflight_hits) / (d.hits + d.misses))
        assert stats.as_dict()["decode"]["goodpred"] == d.goodpred
        backend.close()


def test_unknown_policy_option_is_refused():
    synth = Synthetic(DENSE, layers=1, experts=2, top_k=1, seed=2)
    with pytest.raises(SchedulingError, match=r"unknown option\(s\) \['refresh'\]; known: "):
        backend_for(synth, policy="lru", gpu_expert_slots=2, policy_options={"refresh": True})
    with pytest.raises(SchedulingError, match="prefetch_chunks='matrix'"):
        Mechanisms().with_options({"prefetch_chunks": "matrix"})
    with pytest.raises(SchedulingError, match="predict_in_prefill=1: expected True or False"):
        Mechanisms().with_options({"predict_in_prefill": 1})
    with pytest.raises(ValueError, match="policy_options must be a dict"):
        OffloadConfig(policy_options=[("refresh_on_prefetch", True)])


def test_presets_carry_the_papers_choices():
    """Which mechanism each paper's preset runs (docs/papers.md says why, with the measurement)."""
    assert POLICY_TABLE["duoserve"].mechanisms.predict_in_prefill is False
    assert POLICY_TABLE["finemoe"].mechanisms.prefill_iteration == "pass"
    assert POLICY_TABLE["finemoe"].mechanisms.queue_priority is True
    assert POLICY_TABLE["promoe"].mechanisms.refresh_on_prefetch is True


def test_token_scheduler_regroups_two_batches():
    """ExpertFlow §3.3.2 as written: the tokens of two batches into two balanced batches by routing-path
    similarity. Two kinds of token, X (expert 0 in both layers) and Y (expert 1), alternate in both batches: each
    batch activates 4 (layer, expert) pairs (8 together); X's with X's and Y's with Y's activate 2 each (4)."""
    from moeflow.offload.policies.expertflow.scheduler import activated_pairs, group_by_routing, regroup_two_batches

    def paths(experts: list[int]) -> torch.Tensor:
        p = torch.zeros(len(experts), 2, 4, dtype=torch.bool)
        for i, e in enumerate(experts):
            p[i, :, e] = True
        return p

    a, b = paths([0, 1, 0, 1]), paths([0, 1, 0, 1])
    both = torch.cat([a, b])
    assert activated_pairs(both, [[0, 1, 2, 3], [4, 5, 6, 7]]) == 8
    for seed in range(3):
        first, second = regroup_two_batches(a, b, seed=seed)
        assert (first, second) == ([0, 2, 4, 6], [1, 3, 5, 7])
        assert activated_pairs(both, [first, second]) == 4
    # a batch whose contiguous split is already the best: the paper's clustering returns its own assignment,
    # moeflow's variant keeps the contiguous one (never more pairs than contiguous)
    c = paths([0, 0, 1, 1])
    assert group_by_routing(c, 2, keep_contiguous=True) == [[0, 1], [2, 3]]
    paper = group_by_routing(c, 2, keep_contiguous=False)
    assert sorted(len(g) for g in paper) == [2, 2] and activated_pairs(c, paper) >= 4
    with pytest.raises(ValueError, match="differ in shape"):
        regroup_two_batches(a, paths([0, 1]))


def test_goodpred_timing_model():
    """ProMoE §4.1 offline: Accuracy x FetchRate, FetchRate = min(1, window / predicted, link / predicted)."""
    from moeflow.offload.predictors.evaluate import goodpred

    figs = {"precision": 0.8, "mean_predicted": 2.0}
    # layer-wise (d = 1), prediction 0.5 ms of a 2 ms layer, 1 ms per expert: window 1.5 experts of 2 -> 0.75
    assert goodpred(figs, 1, layer_ms=2, expert_ms=1, predict_ms=0.5)["fetch_rate"] == pytest.approx(0.75)
    # stride (d = 2): window 3.5, the link moves 2 per layer: both predicted experts in time
    g = goodpred(figs, 2, layer_ms=2, expert_ms=1, predict_ms=0.5)
    assert (g["fetch_rate"], g["goodpred"]) == (1.0, pytest.approx(0.8))
    # copy-bound decode (a Mixtral expert over PCIe 4 against a short layer): the link bound, 0.5 / 3.5 per 2
    assert goodpred(figs, 2, layer_ms=0.5, expert_ms=3.5)["fetch_rate"] == pytest.approx(0.5 / 3.5 / 2)
    with pytest.raises(ValueError, match="must be > 0"):
        goodpred(figs, 2, layer_ms=0, expert_ms=1)


def test_routing_stats_of_a_hand_made_trace():
    """Skew, temporal locality and inter-layer affinity on 2 sequences of 3 tokens, 2 layers, 4 experts, top-1.
    Layer 0 routes 0, 0, 1 | 2, 2, 3; layer 1 always routes layer 0's expert + 1 (mod 4): a perfect affinity."""
    from moeflow.trace import Trace
    from moeflow.trace.stats import routing_stats

    l0 = torch.tensor([0, 0, 1, 2, 2, 3])
    ids = torch.stack([l0, (l0 + 1) % 4], dim=1).unsqueeze(-1).int()  # [6, 2, 1]
    trace = Trace(topk_ids=ids, probs=torch.full((6, 2, 4), 0.25, dtype=torch.float16),
                  token_ids=torch.arange(6, dtype=torch.int32), seq_id=torch.tensor([0, 0, 0, 1, 1, 1]).int(),
                  pos=torch.tensor([0, 1, 2, 0, 1, 2]).int(), phase=torch.zeros(6, dtype=torch.int8), num_layers=2,
                  num_experts=4, top_k=1)
    s = routing_stats(trace)
    # layer 0 usage 2, 1, 2, 1 of 6: the busiest share 1/3 over the mean 1/4; the top 10 % (one expert): 1/3
    assert s["max_over_mean_share"][0] == pytest.approx(4 / 3, abs=1e-3)
    assert s["top10pct_share"][0] == pytest.approx(1 / 3, abs=1e-4)
    # consecutive pairs in one sequence: (0,0) (0,1) | (2,2) (2,3): 2 of 4 share their expert, in both layers
    assert s["consecutive_reuse"] == [0.5, 0.5] and s["consecutive_reuse_uniform"] == 0.25
    # layer 1 from layer 0's expert by the co-occurrence table: always right; its most popular expert: 2 of 6
    assert s["affinity_recall"] == [1.0] and s["popularity_recall"] == [pytest.approx(1 / 3, abs=1e-4)]


@pytest.mark.parametrize("iteration", ["token", "pass"])
def test_finemoe_prefill_iteration(iteration):
    """FineMoE §4.1: an iteration of the expert map is a forward pass. A 4-token prefill publishes one map (the
    paper's, "pass") or four (one per prompt token); a decode step of one sequence publishes one either way."""
    from moeflow.moe.backend import StepInfo
    from moeflow.offload.policies import FineMoERuntime
    from moeflow.offload.policies.finemoe.predictor import FineMoEPredictor
    from moeflow.offload.predictors.base import ModelShape

    L, E, H, k = 3, 4, 8, 1
    rt = FineMoERuntime(FineMoEPredictor(ModelShape(num_layers=L, num_experts=E, top_k=k, hidden_size=H), distance=1),
                        iteration)
    gen = torch.Generator().manual_seed(0)

    def run_pass(tokens: int, phase: str) -> None:
        ids = torch.zeros(1, tokens, dtype=torch.long)
        rt.begin_step(StepInfo(ids, ids, torch.ones_like(ids, dtype=torch.bool), phase,
                               embeds=torch.randn(1, tokens, H, generator=gen), all_real=True))
        for layer in range(L):
            probs = torch.softmax(torch.randn(tokens, E, generator=gen), -1)
            rt.observe_host(layer, probs, probs.topk(k, -1).indices)

    run_pass(4, "prefill")
    run_pass(1, "decode")  # publishes the prefill's map(s)
    assert len(rt.store) == (1 if iteration == "pass" else 4)
    run_pass(1, "decode")  # publishes the first decode step's
    assert len(rt.store) == (2 if iteration == "pass" else 5)
