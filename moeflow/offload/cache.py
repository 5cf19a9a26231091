"""The device expert cache: which (layer, expert) sits in which slot of the pool, and in what state.

Slot states:

* ``EMPTY``: holds nothing usable (never filled, evicted by "ondemand", or a cancelled load).
* ``LOADING``: a copy task is filling it; compute must wait on the task before reading.
* ``READY``: the bytes are in place and visible to compute.
* in use (``pins > 0`` on a LOADING or READY slot): the current layer reads it; never evicted.

Every slot also keeps ``fences``: handles that a new write into it must wait for (the compute that last
read it, copies of a cancelled load still in flight). The cache never blocks: it hands the fences to
the next load, which orders itself after them on the transport.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.eviction import EvictionPolicy, Key
from moeflow.offload.stats import PhaseStats
from moeflow.offload.transport import Handle


class SlotState(Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"


@dataclass(eq=False, slots=True)
class Slot:
    index: int
    state: SlotState = SlotState.EMPTY
    key: Key | None = None
    task: LoadTask | None = None  # set while LOADING
    pins: int = 0
    prefetched: bool = False  # loaded ahead of its gate and not used since
    fences: list[Handle] = field(default_factory=list)

    @property
    def in_use(self) -> bool:
        return self.pins > 0

    @property
    def status(self) -> str:
        """State name as the design names it: empty / loading / ready / in-use."""
        return "in-use" if self.in_use else self.state.value


class ExpertCache:
    """Slot bookkeeping; owns no memory (the pool) and moves no bytes (the copy engine)."""

    def __init__(
        self,
        n_slots: int,
        policy: EvictionPolicy,
        *,
        retain: bool = True,
        stats: Callable[[], PhaseStats] | None = None,
        layer_quota: int = 0,
        key_space: tuple[int, int] | None = None,
    ) -> None:
        """key_space: (layers, experts), for policies that rank every key at once (a flag array [L, E])."""
        self.slots = [Slot(i) for i in range(n_slots)]
        self._free = list(range(n_slots))  # heap of empty slot indices (lazy: entries re-checked when popped)
        self._evictable: dict[Key, None] = {}  # resident, READY, not in use: the policy picks among these
        self._flags = np.zeros(key_space, dtype=bool) if key_space is not None else None
        # > 0: per-layer partitioning (mixtral-offloading, ProMoE): a layer at its quota evicts its own
        # experts, one below it takes from a layer above it; slots beyond L * quota are shared
        self.layer_quota = layer_quota
        self._per_layer: Counter[int] = Counter()
        self.where: dict[Key, Slot] = {}
        self.policy = policy
        self.retain = retain  # False: a slot is emptied as soon as its reader releases it ("ondemand")
        self._stats = stats
        self.evictions = 0
        self._loading: dict[int, Slot] = {}  # LOADING slots by index: poll() is per layer, the pool can be large
        self._ready: dict[int, dict[int, int]] = {}  # layer -> {expert: slot index} of its READY slots

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def lookup(self, key: Key) -> Slot | None:
        return self.where.get(key)

    def empty_slots(self) -> int:
        """Slots holding nothing (an empty slot is never in use)."""
        return len(self.slots) - len(self.where)

    def evictable_count(self) -> int:
        """Slots the policy may take now: READY and not in use."""
        return len(self._evictable)

    def is_evictable(self, key: Key) -> bool:
        return key in self._evictable

    def ready_in(self, layer: int) -> tuple[list[int], list[int]]:
        """The experts of ``layer`` in READY slots and those slots (what a layer's early group may read)."""
        ready = self._ready.get(layer)
        return (list(ready), list(ready.values())) if ready else ([], [])

    def resident(self) -> dict[Key, SlotState]:
        return {k: s.state for k, s in self.where.items()}

    # ----------------------------------------------------------------- allocation / eviction
    def allocate(self, key: Key, layer_now: int) -> Slot | None:
        """A slot for ``key``: an empty one, else the policy's victim among ready, unused slots.

        The slot comes back LOADING (the caller attaches its task at once with :meth:`start_load`);
        ``None`` when every slot is loading or in use.
        """
        if key in self.where:
            raise KeyError(f"expert {key} already has slot {self.where[key].index}")
        empty = self._pop_free()
        if empty is None:
            victim = self._victim(key[0], layer_now)
            if victim is None:
                return None
            empty = self.where[victim]
            self._evict(empty)
        empty.key, empty.state = key, SlotState.LOADING
        self.where[key] = empty
        self._loading[empty.index] = empty
        self._per_layer[key[0]] += 1
        return empty

    def _pop_free(self) -> Slot | None:
        """The lowest-index empty slot (O(log n))."""
        while self._free:
            slot = self.slots[heapq.heappop(self._free)]
            if slot.key is None and not slot.in_use:
                return slot
        return None

    def _victim(self, layer: int, layer_now: int) -> Key | None:
        """The policy's choice among the evictable keys; per-layer partitioning narrows it to the layer's own
        (at its quota) or to layers above quota first (never refuses: the quota is a preference)."""
        if not self._evictable:
            return None
        pick, evictable = self.policy.pick, self._evictable
        if self.layer_quota:
            quota, per_layer = self.layer_quota, self._per_layer
            if per_layer[layer] >= quota:
                own = self.policy.pick_in_layer(evictable, layer_now, layer)
                if own is not None:
                    return own
            over = pick(evictable, layer_now, lambda k: per_layer[k[0]] > quota)
            if over is not None:
                return over
        return pick(evictable, layer_now, None, self._flags)

    def _refresh(self, slot: Slot) -> None:
        """Keep the evictable set (and flags) in step with ``slot``'s state."""
        key = slot.key
        if key is None:
            return
        if slot.state is SlotState.READY and slot.pins == 0:
            self._evictable[key] = None
            if self._flags is not None:
                self._flags[key] = True
        elif key in self._evictable:
            del self._evictable[key]
            if self._flags is not None:
                self._flags[key] = False

    def _evict(self, slot: Slot) -> None:
        assert not slot.in_use, f"evicting in-use slot {slot.index}"
        if slot.prefetched and self._stats is not None:
            self._stats().wasted_prefetches += 1
        if slot.key is not None:
            if slot.key in self._evictable:
                del self._evictable[slot.key]
                if self._flags is not None:
                    self._flags[slot.key] = False
            self.policy.evicted(slot.key)
            self._ready.get(slot.key[0], {}).pop(slot.key[1], None)
            del self.where[slot.key]
            self._per_layer[slot.key[0]] -= 1
            self.evictions += 1
        slot.key, slot.state, slot.task, slot.prefetched = None, SlotState.EMPTY, None, False
        self._loading.pop(slot.index, None)
        heapq.heappush(self._free, slot.index)

    def start_load(self, slot: Slot, task: LoadTask, *, prefetched: bool) -> None:
        """``slot`` (from :meth:`allocate`) is being filled by ``task``."""
        slot.state, slot.task, slot.prefetched = SlotState.LOADING, task, prefetched
        self.policy.loaded(slot.key)

    def take_fences(self, slot: Slot) -> list[Handle]:
        """What the next write into ``slot`` must wait for (cleared: the new load now carries them)."""
        fences = [h for h in slot.fences if not h.query()]
        slot.fences = []
        return fences

    def drop(self, slot: Slot, fences: list[Handle]) -> None:
        """The load of ``slot`` was cancelled: it becomes empty once ``fences`` complete."""
        self._evict(slot)
        slot.fences = [*slot.fences, *fences]

    def mark_ready(self, slot: Slot) -> None:
        slot.state, slot.task = SlotState.READY, None
        self._loading.pop(slot.index, None)
        self._ready.setdefault(slot.key[0], {})[slot.key[1]] = slot.index
        self._refresh(slot)

    def fence(self, slot: Slot, fence: Handle) -> None:
        """A compute that may read ``slot`` was enqueued (a layer's early group): the next write into it waits
        for ``fence`` (earlier fences precede it on the compute stream), pins unchanged."""
        slot.fences = [fence]

    def poll(self) -> None:
        """Loads that completed behind our back (prefetches) become READY."""
        for s in list(self._loading.values()):
            if s.task is not None and s.task.complete():
                self.mark_ready(s)

    def loading_unused(self) -> list[Slot]:
        """Loading slots nobody reads now (prefetches): reclaimable by cancelling their load."""
        return [s for s in self._loading.values() if not s.in_use]

    # ----------------------------------------------------------------- use
    def use(self, slot: Slot) -> None:
        """The current layer reads ``slot``: pin it, and credit the prefetch that brought it."""
        slot.pins += 1
        self._refresh(slot)
        if slot.prefetched:
            slot.prefetched = False
            if self._stats is not None:
                st = self._stats()
                st.useful_prefetches += 1
                st.timely_prefetches += slot.state is SlotState.READY  # landed before the gate (FetchRate)

    def release(self, slot: Slot, fence: Handle) -> None:
        """The reader is done issuing its compute; ``fence`` completes when that compute has run."""
        assert slot.pins > 0, f"releasing slot {slot.index} that is not in use"
        slot.pins -= 1
        slot.fences = [fence]  # earlier fences precede this compute, which waited on the slot's load
        if not self.retain and not slot.in_use and slot.state is SlotState.READY:
            self._evict(slot)
        else:
            self._refresh(slot)

    def check(self) -> None:
        """Internal consistency (tests): the map and the slots agree."""
        for key, slot in self.where.items():
            assert slot.key == key and slot.state is not SlotState.EMPTY, (key, slot)
        for slot in self.slots:
            assert (slot.key is None) == (slot.state is SlotState.EMPTY), slot
            assert (slot.task is not None) == (slot.state is SlotState.LOADING), slot
            assert (slot.index in self._loading) == (slot.state is SlotState.LOADING), slot
        assert +self._per_layer == Counter(k[0] for k in self.where), self._per_layer
        evictable = {k for k, s in self.where.items() if s.state is SlotState.READY and not s.in_use}
        assert set(self._evictable) == evictable, (set(self._evictable), evictable)
        if self._flags is not None:
            flagged = {(int(a), int(b)) for a, b in zip(*np.nonzero(self._flags), strict=True)}
            assert flagged == evictable, "evictable flags out of step"
        ready = {(layer, e): i for layer, m in self._ready.items() for e, i in m.items()}
        assert ready == {k: s.index for k, s in self.where.items() if s.state is SlotState.READY}, "ready map"
