"""Eviction policies: which resident expert gives its slot up when another one needs a slot.

One interface: the cache reports gate accesses (:meth:`EvictionPolicy.access`), loads and evictions,
and asks :meth:`EvictionPolicy.victim` to pick among the slots it may evict (resident, not in use).
Predictors plug in through :class:`PriorityEviction` (a score per expert, lowest evicted first, e.g.
FineMoE's ``1 / (p * freq)``) without touching the cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

Key = tuple[int, int]  # (layer, expert)


class EvictionPolicy:
    """Base: least recently used order, with recency shared by every policy for tie-breaks."""

    name = "lru"

    def __init__(self) -> None:
        self._tick = 0
        self.last_use: dict[Key, int] = {}
        self.freq: Counter[Key] = Counter()  # gate accesses over the whole run (kept across evictions)

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def access(self, key: Key) -> None:
        """``key`` was needed at its layer's gate (hit or miss)."""
        self.last_use[key] = self._now()
        self.freq[key] += 1

    def loaded(self, key: Key) -> None:
        """``key`` got a slot (a fresh load counts as recent, else a prefetch would be evicted first)."""
        self.last_use[key] = self._now()

    def evicted(self, key: Key) -> None:
        """``key`` lost its slot."""

    def on_phase(self, phase: str) -> None:
        """The model switched phase ("prefill" / "decode")."""

    def order(self, key: Key) -> tuple:
        """Sort key: the candidate with the smallest value is evicted first."""
        return (self.last_use.get(key, 0),)

    def victim(self, candidates: Sequence[Key], layer_now: int) -> Key:
        """Choose one of ``candidates`` (non-empty: resident, not in use) to evict."""
        return min(candidates, key=self.order)


class LRU(EvictionPolicy):
    """Least recently used (recency of gate accesses and loads)."""

    name = "lru"


class LFU(EvictionPolicy):
    """Least frequently used over the whole run; ties broken by recency."""

    name = "lfu"

    def order(self, key: Key) -> tuple:
        return (self.freq.get(key, 0), self.last_use.get(key, 0))


class Static(LFU):
    """The most popular experts hold their slots for good; the rest of the pool is an LRU ring.

    Popularity comes from :meth:`set_popularity` (an offline profile) or, failing that, from the gate
    counts of the first prefill: the fixed set is frozen at the first switch to decode. Until then it
    behaves like LFU. ``n_fixed`` leaves the streaming ring free.
    """

    name = "static"

    def __init__(self, n_fixed: int) -> None:
        super().__init__()
        self.n_fixed = max(0, n_fixed)
        self.fixed: frozenset[Key] | None = None

    def set_popularity(self, counts: dict[Key, float]) -> None:
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        self.fixed = frozenset(ranked[: self.n_fixed])

    def on_phase(self, phase: str) -> None:
        if phase == "decode" and self.fixed is None:
            self.set_popularity(dict(self.freq))

    def order(self, key: Key) -> tuple:
        if self.fixed is None:
            return super().order(key)
        return (key in self.fixed, self.last_use.get(key, 0))


class PriorityEviction(EvictionPolicy):
    """Evict the lowest ``score(key, layer_now)``; ties by the base policy's order (predictor hook)."""

    def __init__(self, base: EvictionPolicy, score: Callable[[Key, int], float]) -> None:
        super().__init__()
        self.base = base
        self.score = score
        self.name = f"priority+{base.name}"

    def access(self, key: Key) -> None:
        self.base.access(key)

    def loaded(self, key: Key) -> None:
        self.base.loaded(key)

    def evicted(self, key: Key) -> None:
        self.base.evicted(key)

    def on_phase(self, phase: str) -> None:
        self.base.on_phase(phase)

    def victim(self, candidates: Sequence[Key], layer_now: int) -> Key:
        return min(candidates, key=lambda k: (self.score(k, layer_now), *self.base.order(k)))


EVICTION_POLICIES = ("lru", "lfu", "static")


def make_eviction(name: str, *, n_slots: int, ring_slots: int, popularity: Iterable | None = None) -> EvictionPolicy:
    """An eviction policy by name; ``static`` fixes ``n_slots - ring_slots`` experts."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "static":
        policy = Static(n_slots - ring_slots)
        if popularity is not None:
            policy.set_popularity(dict(popularity))
        return policy
    raise ValueError(f"unknown eviction policy {name!r}; known: {EVICTION_POLICIES}")
