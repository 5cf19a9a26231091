"""Eviction policies: which resident expert gives its slot up when another one needs a slot.

One interface: the cache reports gate accesses (:meth:`EvictionPolicy.access`), loads and evictions,
and asks :meth:`EvictionPolicy.victim` to pick among the slots it may evict (resident, not in use).
Predictors plug in through :class:`PriorityEviction` (a score per expert, lowest evicted first, e.g.
FineMoE's ``1 / (p * freq)``) without touching the cache.

The cache calls :meth:`EvictionPolicy.pick` with its set of evictable keys (kept as slots change state) instead
of listing the candidates: LRU walks a recency-ordered dict from the oldest resident key, LFU frequency buckets
(each recency-ordered) from the lowest frequency, both stopping at the first evictable key (O(1) amortised: the
keys skipped are the few in use or loading). A policy that only implements ``victim`` gets the candidate list.
:class:`PriorityEviction` with a ``score_table`` ranks every key in one vectorised pass.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

Key = tuple[int, int]  # (layer, expert)


class EvictionPolicy:
    """Base: least recently used order, with recency shared by every policy for tie-breaks."""

    name = "lru"

    def __init__(self) -> None:
        self._tick = 0
        self.last_use: dict[Key, int] = {}
        self.freq: Counter[Key] = Counter()  # gate accesses over the whole run (kept across evictions)
        self.recency: OrderedDict[Key, None] = OrderedDict()  # resident keys, least recently used first

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def access(self, key: Key) -> None:
        """``key`` was needed at its layer's gate (hit or miss)."""
        self.last_use[key] = self._now()
        self.freq[key] += 1
        if key in self.recency:
            self.recency.move_to_end(key)

    def loaded(self, key: Key) -> None:
        """``key`` got a slot (a fresh load counts as recent, else a prefetch would be evicted first)."""
        self.last_use[key] = self._now()
        self.recency[key] = None
        self.recency.move_to_end(key)

    def evicted(self, key: Key) -> None:
        """``key`` lost its slot."""
        self.recency.pop(key, None)

    def refreshed(self, key: Key) -> None:
        """A resident ``key`` was predicted again (ProMoE: a prefetch of a cached expert touches it): as recent as a
        use, without counting as one (no gate access, frequencies unchanged)."""
        if key in self.recency:
            self.last_use[key] = self._now()
            self.recency.move_to_end(key)

    def pick(self, evictable: Collection[Key], layer_now: int, allowed: Callable[[Key], bool] | None = None,
             flags: np.ndarray | None = None) -> Key | None:
        """The victim among ``evictable`` (resident, ready, not in use) keys passing ``allowed``; None if none.
        ``flags``: the same set as a bool array [L, E] (for vectorised policies)."""
        candidates = [k for k in evictable if allowed is None or allowed(k)]
        return self.victim(candidates, layer_now) if candidates else None

    def pick_in_layer(self, evictable: Collection[Key], layer_now: int, layer: int) -> Key | None:
        """:meth:`pick` restricted to ``layer``'s keys (per-layer partitioning: a layer at its quota evicts its own).
        Default: ``pick`` with that filter; :class:`LRU` keeps a recency order per layer instead."""
        return self.pick(evictable, layer_now, lambda k: k[0] == layer)

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

    def __init__(self) -> None:
        super().__init__()
        # the same order per layer (a subsequence of ``recency``): a layer's own victim without walking every
        # other layer's keys (mixtral-offloading's and ProMoE's per-layer quotas, thousands of slots)
        self._layer_recency: dict[int, OrderedDict[Key, None]] = {}

    def access(self, key: Key) -> None:
        super().access(key)
        order = self._layer_recency.get(key[0])
        if order is not None and key in order:
            order.move_to_end(key)

    def loaded(self, key: Key) -> None:
        super().loaded(key)
        order = self._layer_recency.setdefault(key[0], OrderedDict())
        order[key] = None
        order.move_to_end(key)

    def evicted(self, key: Key) -> None:
        super().evicted(key)
        order = self._layer_recency.get(key[0])
        if order is not None:
            order.pop(key, None)

    def refreshed(self, key: Key) -> None:
        super().refreshed(key)
        order = self._layer_recency.get(key[0])
        if order is not None and key in order:
            order.move_to_end(key)

    def pick(self, evictable, layer_now, allowed=None, flags=None):  # noqa: D102 (the base's)
        for key in self.recency:  # oldest first; skips the few keys in use or loading
            if key in evictable and (allowed is None or allowed(key)):
                return key
        return None

    def pick_in_layer(self, evictable, layer_now, layer):  # noqa: D102 (the base's)
        for key in self._layer_recency.get(layer, ()):  # the layer's oldest first, as ``pick`` would find them
            if key in evictable:
                return key
        return None


class LFU(EvictionPolicy):
    """Least frequently used over the whole run; ties broken by recency."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # frequency -> resident keys, oldest first
        self._levels: list[int] = []  # the frequencies that have a bucket, ascending

    def _place(self, key: Key, old: int | None) -> None:
        if old is not None:
            bucket = self._buckets[old]
            bucket.pop(key, None)
            if not bucket:
                del self._buckets[old]
                self._levels.remove(old)
        f = self.freq.get(key, 0)
        if f not in self._buckets:
            self._buckets[f] = OrderedDict()
            insort(self._levels, f)
        self._buckets[f][key] = None

    def access(self, key: Key) -> None:
        resident = key in self.recency
        super().access(key)
        if resident:
            self._place(key, self.freq[key] - 1)

    def loaded(self, key: Key) -> None:
        resident = key in self.recency
        super().loaded(key)
        self._place(key, self.freq.get(key, 0) if resident else None)

    def evicted(self, key: Key) -> None:
        if key in self.recency:
            f = self.freq.get(key, 0)
            bucket = self._buckets[f]
            bucket.pop(key, None)
            if not bucket:
                del self._buckets[f]
                self._levels.remove(f)
        super().evicted(key)

    def order(self, key: Key) -> tuple:
        return (self.freq.get(key, 0), self.last_use.get(key, 0))

    def pick(self, evictable, layer_now, allowed=None, flags=None):  # noqa: D102 (the base's)
        for f in self._levels:  # lowest frequency first, oldest first within it
            for key in self._buckets[f]:
                if key in evictable and (allowed is None or allowed(key)):
                    return key
        return None


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
        self._ring: OrderedDict[Key, None] = OrderedDict()  # resident keys outside the placement, LRU first

    def set_popularity(self, counts: dict[Key, float]) -> None:
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        self.fixed = frozenset(ranked[: self.n_fixed])
        self._ring = OrderedDict((k, None) for k in self.recency if k not in self.fixed)

    def access(self, key: Key) -> None:
        super().access(key)
        if key in self._ring:
            self._ring.move_to_end(key)

    def loaded(self, key: Key) -> None:
        super().loaded(key)
        if self.fixed is not None and key not in self.fixed:
            self._ring[key] = None
            self._ring.move_to_end(key)

    def evicted(self, key: Key) -> None:
        super().evicted(key)
        self._ring.pop(key, None)

    def on_phase(self, phase: str) -> None:
        if phase == "decode" and self.fixed is None:
            self.set_popularity(dict(self.freq))

    def order(self, key: Key) -> tuple:
        if self.fixed is None:
            return super().order(key)
        return (key in self.fixed, self.last_use.get(key, 0))

    def pick(self, evictable, layer_now, allowed=None, flags=None):  # noqa: D102 (the base's)
        if self.fixed is None:
            return super().pick(evictable, layer_now, allowed, flags)
        for key in self._ring:  # the streaming ring in LRU order (its own ordered dict: O(1) amortised) ...
            if key in evictable and (allowed is None or allowed(key)):
                return key
        fixed = self.fixed
        for key in self.recency:  # ... the placement last
            if key in fixed and key in evictable and (allowed is None or allowed(key)):
                return key
        return None


class PriorityEviction(EvictionPolicy):
    """Evict the lowest ``score(key, layer_now)``; ties by the base policy's order (predictor hook).

    ``score_table(layer_now)``, when given, returns every key's score at once (float array [L * E], the same
    values ``score`` gives): the victim is then chosen in one vectorised pass over the cache's flags.
    """

    def __init__(self, base: EvictionPolicy, score: Callable[[Key, int], float],
                 score_table: Callable[[int], np.ndarray] | None = None) -> None:
        super().__init__()
        self.base = base
        self.score = score
        self.score_table = score_table
        self.name = f"priority+{base.name}"

    def pick(self, evictable, layer_now, allowed=None, flags=None):  # noqa: D102 (the base's)
        if self.score_table is None or flags is None or allowed is not None:
            return super().pick(evictable, layer_now, allowed, flags)
        masked = np.where(flags, self.score_table(layer_now), np.inf)
        i = int(masked.argmin())
        low = masked.flat[i]
        if low == np.inf:
            return None
        E = flags.shape[1]
        if np.count_nonzero(masked == low) == 1:  # the usual case: no tie to break
            return (i // E, i % E)
        keys = [(int(j) // E, int(j) % E) for j in np.flatnonzero(masked == low)]
        return min(keys, key=self.base.order)

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
