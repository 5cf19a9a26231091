"""Runtime units, part 2: the slot cache (allocation, pins, eviction order, prefetch bookkeeping), the offload
config and the stats (part 1, transports / host store / copy engine: test_scheduling_units.py)."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
import torch
from test_scheduling_helpers import DENSE

from moeflow.config import OffloadConfig
from moeflow.offload import (
    LFU,
    LRU,
    POLICY_TABLE,
    ExpertCache,
    PriorityEviction,
    RandomDelayTransport,
    SlotState,
    Static,
    Stats,
    make_eviction,
)
from moeflow.offload.transport import DONE


# ---------------------------------------------------------------------------------------------- cache
def _load(cache, key, layer_now=0, prefetched=False):
    slot = cache.allocate(key, layer_now)
    if slot is None:
        return None

    class _T:  # a finished task
        def complete(self):
            return True

    cache.start_load(slot, _T(), prefetched=prefetched)
    cache.mark_ready(slot)
    return slot


def test_slot_states_and_release():
    cache = ExpertCache(2, LRU())
    s = cache.allocate((0, 1), 0)
    assert s.state is SlotState.LOADING and s.status == "loading"
    cache.start_load(s, object(), prefetched=False)
    cache.use(s)
    assert s.status == "in-use"
    cache.mark_ready(s)
    cache.release(s, DONE)
    assert s.status == "ready" and cache.lookup((0, 1)) is s
    cache.check()


def test_eviction_never_takes_an_in_use_slot():
    rng = random.Random(0)
    for policy in (LRU(), LFU(), Static(2)):
        cache = ExpertCache(4, policy)
        for step in range(400):
            layer = step % 3
            wanted = rng.sample(range(6), rng.randint(1, 3))
            pinned = []
            for e in wanted:
                key = (layer, e)
                policy.access(key)
                slot = cache.lookup(key) or _load(cache, key, layer)
                if slot is None:
                    continue
                assert slot.key == key
                cache.use(slot)
                pinned.append(slot)
            # a pinned slot keeps its expert whatever else is loaded meanwhile
            for e in range(6):
                _load(cache, ((layer + 1) % 3, e), layer) if cache.lookup(((layer + 1) % 3, e)) is None else None
            for slot in pinned:
                assert slot.in_use and slot.key[0] == layer
                cache.release(slot, DONE)
            cache.check()
            if step == 200:
                policy.on_phase("decode")


def test_lru_lfu_static_victims():
    lru = ExpertCache(2, LRU())
    _load(lru, (0, 0))
    _load(lru, (0, 1))
    lru.policy.access((0, 0))
    _load(lru, (0, 2))  # evicts (0, 1): least recently used
    assert set(lru.where) == {(0, 0), (0, 2)}

    lfu = ExpertCache(2, LFU())
    for _ in range(3):
        lfu.policy.access((0, 1))
    _load(lfu, (0, 0))
    _load(lfu, (0, 1))
    lfu.policy.access((0, 0))
    _load(lfu, (0, 2))  # evicts (0, 0): used once, against three times
    assert set(lfu.where) == {(0, 1), (0, 2)}

    static = Static(n_fixed=1)
    cache = ExpertCache(2, static)
    for key, n in (((0, 3), 5), ((0, 4), 1)):
        for _ in range(n):
            static.access(key)
    static.on_phase("decode")  # freezes the most popular: (0, 3)
    assert static.fixed == {(0, 3)}
    _load(cache, (0, 3))
    for e in range(5):
        _load(cache, (1, e))  # the ring churns, the fixed expert stays
    assert cache.lookup((0, 3)) is not None


def test_priority_hook_overrides_base_order():
    scores = {(0, 0): 0.9, (0, 1): 0.1}
    policy = PriorityEviction(LRU(), lambda key, layer_now: scores.get(key, 0.5))
    cache = ExpertCache(2, policy)
    _load(cache, (0, 1))
    _load(cache, (0, 0))
    policy.access((0, 1))  # most recent, but lowest score
    _load(cache, (0, 2))
    assert set(cache.where) == {(0, 0), (0, 2)}
    assert make_eviction("lfu", n_slots=4, ring_slots=2).name == "lfu"
    with pytest.raises(ValueError, match="unknown eviction"):
        make_eviction("mru", n_slots=4, ring_slots=2)


def test_wasted_and_useful_prefetch_counting():
    stats = Stats()
    cache = ExpertCache(1, LRU(), stats=stats.current)
    s = _load(cache, (1, 0), prefetched=True)
    cache.use(s)
    cache.release(s, DONE)
    assert stats.prefill.useful_prefetches == 1
    _load(cache, (1, 1), prefetched=True)
    _load(cache, (1, 2))  # evicts the unused prefetch
    assert stats.prefill.wasted_prefetches == 1


def test_ondemand_cache_forgets_after_use():
    cache = ExpertCache(2, LRU(), retain=False)
    s = _load(cache, (0, 0))
    cache.use(s)
    cache.release(s, DONE)
    assert cache.lookup((0, 0)) is None and s.state is SlotState.EMPTY and s.fences == [DONE]


# ---------------------------------------------------------------------------------------------- config, stats
def test_every_builtin_policy_is_documented_in_the_readme():
    """The README's policy table (first column, backticked names) lists exactly the built-in policies."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Policies", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    documented = {name for cell in rows for name in re.findall(r"`([a-z0-9-]+)`", cell)}
    assert documented == set(POLICY_TABLE)
    with pytest.raises(ValueError, match="copy_chunks"):
        OffloadConfig(copy_chunks=0)
    with pytest.raises(ValueError, match="random_delay_ms"):
        OffloadConfig(random_delay_ms=-1)


def test_stats_api_kept():
    stats = Stats()
    stats.set_phase("decode")
    stats.current().hits += 3
    stats.current().misses += 1
    stats.ttft_s, stats.tpot_s = 0.5, 0.1
    d = stats.as_dict()
    assert d["decode"]["hit_rate"] == 0.75 and d["hit_rate"] == 0.75 and d["ttft_s"] == 0.5
    assert "10.0 tok/s" in stats.summary()
    stats.expert_pool_bytes = 123
    stats.reset()
    assert stats.decode.hits == 0 and stats.ttft_s is None and stats.expert_pool_bytes == 123
    with pytest.raises(ValueError):
        stats.set_phase("train")


def test_random_delay_transport_is_fast_enough_for_tests():
    t = RandomDelayTransport(max_delay_s=0.0005)
    t0 = time.perf_counter()
    hs = [t.copy(torch.zeros(4), torch.ones(4)) for _ in range(50)]
    for h in hs:
        h.synchronize()
    assert time.perf_counter() - t0 < 5.0
    t.close()


def test_registered_policy_plugs_predictor_and_eviction():
    from test_scheduling_helpers import Synthetic

    from moeflow.offload import PolicySpec, Predictor, register_policy, unregister_policy

    built = {}

    class Fixed(Predictor):
        def observe(self, layer, x, probs, topk_ids):
            built["observed"] = built.get("observed", 0) + 1

        def propose(self, layer, x):
            return [(layer + 1, torch.tensor([0, 1]))] if layer + 1 < 3 else []

    def make_predictor(ctx):
        built["ctx"] = ctx
        return Fixed()

    register_policy(PolicySpec("test-fixed", predictor=make_predictor, eviction=lambda ctx: LFU()))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_policy(PolicySpec("test-fixed"))
        synth = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=2, steps=4)
        expected = synth.run(synth.resident())
        backend, stats = synth.offloaded(policy="test-fixed", gpu_expert_slots=5)
        got = synth.run(backend, stats)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        assert built["ctx"].n_slots == 5 and built["observed"] == 12 and backend.cache.policy.name == "lfu"
        assert stats.prefill.prefetches + stats.decode.prefetches > 0
        backend.close()
    finally:
        unregister_policy("test-fixed")


def test_cuda_default_budget_from_device_memory(monkeypatch):
    from moeflow.errors import SchedulingError
    from moeflow.offload import resolve_slots

    class Props:
        total_memory = int(10 * DENSE.nbytes / 0.9) + 1

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    kw = dict(fmt=DENSE, num_layers=4, num_experts=8, top_k=2, device=torch.device("cuda"))
    assert resolve_slots(OffloadConfig(policy="lru"), reserved_bytes=2 * DENSE.nbytes, **kw) == 8
    with pytest.raises(SchedulingError, match="resident.*32 experts"):
        resolve_slots(OffloadConfig(policy="resident"), reserved_bytes=0, **kw)


def test_per_layer_quota_partitions_the_pool():
    cache = ExpertCache(6, LRU(), layer_quota=2)  # 3 layers x 2
    for layer in range(3):
        for e in range(2):
            _load(cache, (layer, e))
    _load(cache, (0, 5))  # layer 0 at its quota: evicts its own least recent, not layer 1's older ones
    assert sorted(k for k in cache.where if k[0] == 0) == [(0, 1), (0, 5)]
    assert sum(1 for k in cache.where if k[0] == 1) == 2
    cache.check()
    # a layer below quota takes from a layer above it
    unbalanced = ExpertCache(4, LRU(), layer_quota=2)
    for e in range(4):
        _load(unbalanced, (0, e))
    _load(unbalanced, (1, 0))
    assert sum(1 for k in unbalanced.where if k[0] == 0) == 3
    unbalanced.check()
