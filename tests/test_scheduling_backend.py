"""The offloaded backend gives bitwise the outputs of ResidentExperts, for every policy, slot count and transport."""

from __future__ import annotations

import pytest
import torch
from test_scheduling_helpers import AWQ, DENSE, Synthetic

from moeflow.errors import SchedulingError
from moeflow.kernels.formats import ALIGN
from moeflow.moe import ResidentExperts
from moeflow.offload import OffloadedExperts, Stats

OFFLOAD_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")


@pytest.fixture(scope="module")
def dense():
    s = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=1)
    return s, s.run(s.resident())


def _check_equal(expected, got):
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"layer call {i} differs"


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_every_slot_count_matches_resident(dense, policy, transport):
    synth, expected = dense
    for n_slots in range(2, synth.L * synth.E + 1):
        backend, stats = synth.offloaded(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.5, seed=n_slots
        )
        try:
            got = synth.run(backend, stats)
        finally:
            backend.close()
        _check_equal(expected, got)


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", ["lru", "mixtral-offloading", "ondemand"])
def test_awq_format_matches_resident(policy, transport):
    synth = Synthetic(AWQ, layers=2, experts=5, top_k=2, seed=3, steps=5)
    expected = synth.run(synth.resident())
    for n_slots in (2, 3, 6, 10):
        backend, stats = synth.offloaded(policy=policy, gpu_expert_slots=n_slots, transport=transport,
                                         random_delay_ms=0.5, copy_chunks=4)
        try:
            _check_equal(expected, synth.run(backend, stats))
        finally:
            backend.close()


def test_top_k_three_and_prime_experts():
    synth = Synthetic(DENSE, layers=2, experts=7, top_k=3, seed=5, steps=6, prefill_tokens=9)
    expected = synth.run(synth.resident())
    for policy in ("lru", "mixtral-offloading"):
        for n_slots in (3, 4, 8, 14):
            backend, stats = synth.offloaded(policy=policy, gpu_expert_slots=n_slots, transport="random-delay",
                                             random_delay_ms=0.5, max_inflight_chunks=3)
            try:
                _check_equal(expected, synth.run(backend, stats))
            finally:
                backend.close()


def test_resident_policy_returns_resident_experts(dense):
    synth, _ = dense
    backend, _ = synth.offloaded(policy="resident")
    assert isinstance(backend, ResidentExperts)
    with pytest.raises(SchedulingError, match="resident"):
        synth.offloaded(policy="resident", gpu_expert_slots=5)


def test_slot_minimum_is_refused_with_the_minimum(dense):
    synth, _ = dense
    with pytest.raises(SchedulingError, match="minimum is 2"):
        synth.offloaded(policy="lru", gpu_expert_slots=1)
    with pytest.raises(SchedulingError, match="minimum is 4"):
        synth.offloaded(policy="lru", gpu_expert_slots=3, prefill_ring_slots=4)
    with pytest.raises(SchedulingError, match="known policies: .*'lru'.*'mixtral-offloading'"):
        synth.offloaded(policy="nope", gpu_expert_slots=4)


def test_gpu_memory_budget_gives_slots(dense):
    synth, _ = dense
    n = 5
    budget_gb = n * DENSE.nbytes / 2**30 + 1e-9
    backend, _ = synth.offloaded(policy="lru", gpu_memory_gb=budget_gb)
    assert isinstance(backend, OffloadedExperts) and backend.n_slots == n
    backend.close()
    with pytest.raises(SchedulingError, match="minimum is 2"):
        synth.offloaded(policy="lru", gpu_memory_gb=1.5 * DENSE.nbytes / 2**30)
    huge, _ = synth.offloaded(policy="lru", gpu_memory_gb=10.0)
    assert huge.n_slots == synth.L * synth.E  # never more slots than experts
    huge.close()


def test_stats_add_up_sync(dense):
    synth, expected = dense
    needed = synth.needed_per_call()
    for policy in OFFLOAD_POLICIES:
        for n_slots in (2, 5, 9, 18):
            stats = Stats()
            backend, _ = synth.offloaded(stats, policy=policy, gpu_expert_slots=n_slots, transport="sync")
            _check_equal(expected, synth.run(backend, stats))
            p, d = stats.prefill, stats.decode
            assert p.hits + p.misses == needed[0] * 0 + sum(needed[: synth.L])
            assert d.hits + d.misses == sum(needed[synth.L :])
            for ph in (p, d):
                # every byte moved is a whole expert: a miss or a prefetch (nothing is cancelled in sync mode)
                assert ph.bytes_h2d == (ph.misses + ph.prefetches) * DENSE.nbytes
                assert ph.useful_prefetches <= ph.prefetches + (p.prefetches if ph is d else 0)
            assert p.prefetches + d.prefetches >= p.useful_prefetches + d.useful_prefetches + d.wasted_prefetches \
                + p.wasted_prefetches - 0
            if policy == "ondemand":
                assert p.hits == d.hits == 0
            if n_slots == synth.L * synth.E and policy != "ondemand":
                assert p.misses == d.misses == 0  # warm start holds everything
            if policy != "mixtral-offloading":
                assert p.prefetches == d.prefetches == 0
            assert stats.as_dict()["decode"]["hit_rate"] == d.hit_rate
            assert "hit rate" in stats.summary()
            backend.close()


def test_speculation_prefetches_and_counts_use():
    synth = Synthetic(DENSE, layers=4, experts=6, top_k=2, seed=7, steps=10)
    expected = synth.run(synth.resident())
    backend, stats = synth.offloaded(policy="mixtral-offloading", gpu_expert_slots=6, transport="sync")
    _check_equal(expected, synth.run(backend, stats))
    d = stats.decode
    assert d.prefetches > 0
    assert d.useful_prefetches + d.wasted_prefetches <= d.prefetches + stats.prefill.prefetches
    backend.close()


def test_random_delay_stats_bytes_are_chunk_multiples(dense):
    synth, expected = dense
    backend, stats = synth.offloaded(policy="mixtral-offloading", gpu_expert_slots=4, transport="random-delay",
                                     random_delay_ms=1.0)
    _check_equal(expected, synth.run(backend, stats))
    backend.synchronize()
    moved = stats.prefill.bytes_h2d + stats.decode.bytes_h2d
    misses = stats.prefill.misses + stats.decode.misses
    prefetches = stats.prefill.prefetches + stats.decode.prefetches
    assert misses * DENSE.nbytes <= moved <= (misses + prefetches) * DENSE.nbytes
    # the chunks tile the expert region at ALIGN boundaries; all but the last have the same size
    starts = [a for a, _ in backend.engine.chunks]
    assert starts[0] == 0 and backend.engine.chunks[-1][1] == DENSE.nbytes and len(starts) == 3
    assert all(b == a2 for (_, b), (a2, _) in zip(backend.engine.chunks[:-1], backend.engine.chunks[1:], strict=True))
    sizes = [b - a for a, b in backend.engine.chunks]
    assert all(a % ALIGN == 0 for a in starts) and set(sizes[:-1]) == {sizes[0]}
    assert 0 < sizes[-1] <= sizes[0]
    # a cancelled prefetch moved a prefix of its chunks: what is not whole experts is whole leading chunks
    step, extra = starts[1], moved - misses * DENSE.nbytes
    assert any((extra - n * DENSE.nbytes) % step == 0 for n in range(prefetches + 1) if extra >= n * DENSE.nbytes)
    backend.close()


def test_backend_repr_and_pool_size(dense):
    synth, _ = dense
    backend, stats = synth.offloaded(policy="lfu", gpu_expert_slots=4)
    assert "lfu" in repr(backend) and stats.expert_pool_bytes == 4 * DENSE.nbytes
    assert stats.host_store_bytes == synth.L * synth.E * DENSE.nbytes and stats.host_pinned is False
    backend.close()


def test_preemption_paths_run_under_random_delays(monkeypatch):
    from moeflow.offload.copy_engine import CopyEngine

    synth = Synthetic(DENSE, layers=4, experts=6, top_k=2, seed=1, steps=12)
    expected = synth.run(synth.resident())
    seen = {"promoted": 0, "dropped": 0}
    preempt = CopyEngine.preempt

    def spy(self, layer, needed):
        promoted, dropped = preempt(self, layer, needed)
        seen["promoted"] += len(promoted)
        seen["dropped"] += len(dropped)
        return promoted, dropped

    monkeypatch.setattr(CopyEngine, "preempt", spy)
    inflight_hits = 0
    for n_slots in (5, 8, 12):
        backend, stats = synth.offloaded(policy="mixtral-offloading", gpu_expert_slots=n_slots,
                                         transport="random-delay", random_delay_ms=3.0)
        _check_equal(expected, synth.run(backend, stats))
        inflight_hits += stats.prefill.inflight_hits + stats.decode.inflight_hits
        backend.close()
    # slow copies: some predictions are still queued at their gate (promoted or dropped), some in flight
    assert seen["promoted"] > 0 and seen["dropped"] > 0 and inflight_hits > 0


def test_reordered_inference_computes_resident_experts_first(dense, monkeypatch):
    synth, expected = dense
    calls: list[dict] = []
    forward, compute = OffloadedExperts.forward, OffloadedExperts._compute

    def spy_forward(self, layer, x, probs, ids, w):
        needed = sorted(set(ids.reshape(-1).tolist()))
        ready = [e for e in needed if (s := self.cache.lookup((layer, e))) is not None and s.state.value == "ready"]
        calls.append({"needed": needed, "ready": ready, "groups": []})
        return forward(self, layer, x, probs, ids, w)

    def spy_compute(self, layer, x, ids, w, out, experts, **kw):
        calls[-1]["groups"].append(sorted(experts))
        return compute(self, layer, x, ids, w, out, experts, **kw)

    monkeypatch.setattr(OffloadedExperts, "forward", spy_forward)
    monkeypatch.setattr(OffloadedExperts, "_compute", spy_compute)
    for n_slots in (3, 7):
        backend, stats = synth.offloaded(policy="lru", gpu_expert_slots=n_slots, transport="sync")
        _check_equal(expected, synth.run(backend, stats))
        backend.close()
    mixed = 0
    for call in calls:
        groups = call["groups"]
        assert sorted(e for g in groups for e in g) == call["needed"]  # every needed expert exactly once
        if call["ready"]:
            assert groups[0] == call["ready"]  # resident experts first, in one kernel call
            assert not any(set(g) & set(call["ready"]) for g in groups[1:])
            mixed += len(groups) > 1
    assert mixed > 0  # some calls had both resident and loaded experts


def test_failed_layer_leaves_no_slot_pinned(dense, monkeypatch):
    from moeflow import kernels

    synth, expected = dense
    backend, stats = synth.offloaded(policy="lru", gpu_expert_slots=2, transport="random-delay", random_delay_ms=0.5)
    real = kernels.expert_forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "expert_forward", flaky)
    phase, layer, x, probs, ids, w = next(iter(synth.calls()))
    with pytest.raises(RuntimeError, match="simulated"):
        backend.forward(layer, x, probs, ids, w)
    assert not any(s.in_use for s in backend.cache.slots)
    _check_equal(expected, synth.run(backend, stats))  # and the backend still works
    backend.close()
