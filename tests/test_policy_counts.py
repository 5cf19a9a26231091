"""Pinned behaviour of each policy on small hand-made traces: hit / miss / prefetch counts and the resident set.

Nothing here is timed: with the synchronous transport every count is a function of the trace, so each expected
number below is derived by hand in the comment next to it (warm start: slot i holds expert (i % L, i // L), loaded
in slot order). A policy change that only moves hit rates (a recency rule, the speculation's router, the ring)
fails here while every exact-token test still passes.
"""

from __future__ import annotations

import pytest
import torch
from test_scheduling_helpers import DENSE, Synthetic

from moeflow.offload import CopyEngine, Stats, SyncTransport


def backend_for(synth: Synthetic, spec_changes: dict | None = None, **config):
    return synth.offloaded(transport="sync", spec_changes=spec_changes, **config)


def step(backend, stats, layer: int, experts: list[int], phase: str = "decode", x: torch.Tensor | None = None):
    """One token routed to ``experts`` (k of them) at ``layer``; returns the resident experts of that layer after."""
    stats.set_phase(phase)
    k = len(experts)
    ids = torch.tensor([experts], dtype=torch.int32)
    probs = torch.zeros(1, backend.num_experts)
    probs[0, experts] = 1.0 / k
    x = torch.zeros(1, backend.fmt.hidden_size) if x is None else x
    with torch.no_grad():
        backend.forward(layer, x, probs, ids, torch.full((1, k), 1.0 / k))
    backend.cache.check()
    return resident(backend, layer)


def resident(backend, layer: int) -> set[int]:
    return {e for (lay, e) in backend.cache.where if lay == layer}


def totals(stats: Stats) -> tuple[int, int, int, int]:
    p, d = stats.prefill, stats.decode
    return p.hits + d.hits, p.misses + d.misses, p.prefetches + d.prefetches, p.useful_prefetches + d.useful_prefetches


@pytest.fixture(scope="module")
def one_layer():
    return Synthetic(DENSE, layers=1, experts=4, top_k=1, seed=2)


def test_lru_counts_fresh_loads_and_accesses_as_recent(one_layer):
    backend, stats = backend_for(one_layer, policy="lru", gpu_expert_slots=2)
    # warm start: 0 (tick 1), 1 (tick 2)
    assert step(backend, stats, 0, [0]) == {0, 1}  # hit; 0 -> tick 3
    backend.prefetch(0, [2], layer_now=0)  # evicts 1 (tick 2 < 3); the fresh load of 2 -> tick 4
    assert resident(backend, 0) == {0, 2}
    assert step(backend, stats, 0, [3]) == {2, 3}  # miss: evicts 0 (3 < 4), not the fresh prefetch
    assert step(backend, stats, 0, [2]) == {2, 3}  # hit on the prefetch
    assert totals(stats) == (2, 1, 1, 1)  # hits, misses, prefetches, useful prefetches
    backend.close()


def test_lfu_keeps_the_frequent_expert(one_layer):
    backend, stats = backend_for(one_layer, policy="lfu", gpu_expert_slots=2)
    trace = [0, 0, 0, 1, 2, 0, 1, 2]
    # freq after the hits: 0 x3, 1 x1; miss 2 evicts 1 (LRU would evict 0); 0 hits; miss 1 evicts 2 (freq 1 < 4,
    # and 2 is more recent); miss 2 evicts 1 (freq 2 < 4)
    expected = [{0, 1}, {0, 1}, {0, 1}, {0, 1}, {0, 2}, {0, 2}, {0, 1}, {0, 2}]
    assert [step(backend, stats, 0, [e]) for e in trace] == expected
    assert totals(stats) == (5, 3, 0, 0)
    backend.close()


def test_static_never_evicts_the_fixed_expert():
    synth = Synthetic(DENSE, layers=1, experts=5, top_k=1, seed=2)
    backend, stats = backend_for(synth, policy="static", gpu_expert_slots=3)  # 3 - ring of 2 = 1 fixed expert
    for _ in range(3):
        step(backend, stats, 0, [0], phase="prefill")  # 0 is the prefill's most used: fixed at the switch
    # decode: 3, 1, 2, 3 all miss and cycle through the 2-slot ring (LRU) around the fixed 0; then 0 hits
    got = [step(backend, stats, 0, [e]) for e in (3, 1, 2, 3, 0)]
    assert got == [{0, 2, 3}, {0, 1, 3}, {0, 1, 2}, {0, 2, 3}, {0, 2, 3}]
    assert (stats.prefill.hits, stats.decode.hits, stats.decode.misses) == (3, 1, 4)
    backend.close()


def speculation_trace() -> Synthetic:
    """2 layers, 6 experts, k = 2. Layer 0's input alternates e_0 / e_1; layer 0 always routes to {4, 5}; layer 1
    routes to the top 2 of *its own* router on layer 0's input: {0, 1} after e_0, {2, 3} after e_1. Layer 0's
    router on that input says {4, 5}; layer 1's least likely experts are {4, 5} too: only the next layer's router
    applied to the current input prefetches the right experts."""
    synth = Synthetic(DENSE, layers=2, experts=6, top_k=2, seed=3)
    with torch.no_grad():
        for gate in synth.gates:
            gate.weight.zero_()
        synth.gates[0].weight[4, :2] = 5.0
        synth.gates[0].weight[5, :2] = 4.0
        synth.gates[1].weight[:, 0] = torch.tensor([5.0, 4.0, 0.0, 0.0, -5.0, -4.0])
        synth.gates[1].weight[:, 1] = torch.tensor([0.0, 0.0, 5.0, 4.0, -5.0, -4.0])
    return synth


def test_mixtral_offloading_speculates_with_the_next_layers_router():
    synth = speculation_trace()
    backend, stats = backend_for(synth, policy="mixtral-offloading", gpu_expert_slots=4)  # 2 slots per layer
    steps = 5
    for t in range(steps):
        x0 = torch.zeros(1, synth.fmt.hidden_size)
        x0[0, t % 2] = 1.0
        step(backend, stats, 0, [4, 5], x=x0)
        assert step(backend, stats, 1, [0, 1] if t % 2 == 0 else [2, 3]) == ({0, 1} if t % 2 == 0 else {2, 3})
    # step 0: layer 0 misses 4 and 5 (warm start holds 0, 1 of each layer); its guess {0, 1} for layer 1 is
    # resident already, layer 1 hits twice. Steps 1-4: layer 0 hits twice and prefetches layer 1's two experts
    # (evicting layer 1's previous pair), which then hit: 2 + 4 * 4 hits, 2 misses, 8 prefetches, all useful.
    assert totals(stats) == (2 + 4 * (steps - 1), 2, 2 * (steps - 1), 2 * (steps - 1))
    assert stats.decode.wasted_prefetches == 0
    backend.close()


def test_duoserve_ring_holds_at_most_k_loads_per_layer():
    """Prefill of a layer that needs all 8 experts with 3 resident: 5 misses stream through a ring of k = 2 slots."""
    synth = Synthetic(DENSE, layers=2, experts=8, top_k=2, seed=4)
    backend, stats = backend_for(synth, {"prefill_ring": True}, policy="lru", gpu_expert_slots=6)
    outstanding, peak = 0, 0
    submit, compute = backend.engine.submit, backend._compute

    def counting_submit(layer, expert, slot, **kw):
        nonlocal outstanding, peak
        outstanding += kw.get("high", False)
        peak = max(peak, outstanding)
        return submit(layer, expert, slot, **kw)

    def counting_compute(layer, x, ids, w, out, experts, **kw):
        nonlocal outstanding
        outstanding -= sum(e not in (0, 1, 2) for e in experts)  # the loaded ones (0, 1, 2 were warm)
        return compute(layer, x, ids, w, out, experts, **kw)

    backend.engine.submit, backend._compute = counting_submit, counting_compute
    stats.set_phase("prefill")
    x = torch.randn(4, synth.fmt.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    probs = torch.full((4, 8), 1 / 8)
    with torch.no_grad():
        got = backend.forward(0, x, probs, ids, torch.full((4, 2), 0.5))
        want = synth.resident().forward(0, x, probs, ids, torch.full((4, 2), 0.5))
    assert torch.equal(got, want)
    assert (stats.prefill.hits, stats.prefill.misses) == (3, 5)
    assert peak == 2 and outstanding == 0
    backend.close()


def test_low_queue_takes_the_highest_priority_first():
    """FineMoE's prefetch priority p / (l - l_now) orders the low queue: the copy engine issues by it (ties in
    arrival order), and a high task still goes before every low one."""
    synth = Synthetic(DENSE, layers=1, experts=6, top_k=1, seed=5)
    backend, _ = backend_for(synth, policy="lru", gpu_expert_slots=6)
    engine = CopyEngine(SyncTransport(), backend.host, backend.pool, chunks=1)
    issued = []
    real_issue = engine._issue_next

    def recording_issue():
        queue = engine._high or engine._low
        if queue:
            issued.append(queue[0].expert)
        return real_issue()

    engine._issue_next = recording_issue
    for expert, prio in [(0, 0.1), (1, 0.9), (2, 0.5), (3, 0.9), (4, 0.0)]:
        engine.submit(0, expert, expert, high=False, priority=prio)
    engine.submit(0, 5, 5, high=True)
    assert [t.expert for t in engine.pending()] == [5, 1, 3, 2, 0, 4]
    engine.pump()
    assert issued == [5, 1, 3, 2, 0, 4]
    engine.close()
    backend.close()


@pytest.mark.parametrize("issued", [0, 1, 3], ids=["queued", "half-issued", "issued"])
def test_a_load_the_cpu_beat_is_cancelled_and_frees_its_slot(one_layer, issued):
    """A hybrid race the CPU won (``SlotLoader.release_unread``): the load's chunks not yet issued are cancelled
    (they would hold the link at high priority ahead of the next layers' loads) and its slot is empty again; a load
    fully issued already lands and stays cached."""
    backend, stats = backend_for(one_layer, policy="lru", gpu_expert_slots=2, copy_chunks=3)
    step(backend, stats, 0, [2])  # evicts 0: expert 2 is resident, 1 too; 0 and 3 are not
    slot = backend.cache.allocate((0, 3), 0)
    task = backend.engine.submit(0, 3, slot.index, high=True, after=backend.cache.take_fences(slot))
    backend.cache.start_load(slot, task, prefetched=False)
    backend.cache.use(slot)  # the layer waits for it ...
    backend.engine.batch_bytes = task.chunks[0][1]  # one chunk per issue (else the sync transport takes all 3)
    backend.engine.pump(issued)
    backend.loads.release_unread(task)  # ... and the CPU finished first
    backend.cache.check()
    assert task not in backend.engine.pending()
    if issued == 3:
        assert not task.cancelled and backend.cache.lookup((0, 3)) is slot and stats.decode.cpu_race_cancels == 0
        backend.cache.poll()
        assert resident(backend, 0) == {2, 3}
    else:
        assert task.cancelled and backend.engine.cancelled_chunks == 3 - issued
        assert backend.cache.lookup((0, 3)) is None and resident(backend, 0) == {2}
        assert stats.decode.cpu_race_cancels == 1
        assert step(backend, stats, 0, [0]) == {0, 2}  # the slot is free and reused consistently
    backend.close()

