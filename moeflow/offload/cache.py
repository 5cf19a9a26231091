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

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.eviction import EvictionPolicy, Key
from moeflow.offload.stats import PhaseStats
from moeflow.offload.transport import Handle


class SlotState(Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"


@dataclass(eq=False)
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
    ) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
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

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def lookup(self, key: Key) -> Slot | None:
        return self.where.get(key)

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
        empty = next((s for s in self.slots if s.key is None and not s.in_use), None)
        if empty is None:
            candidates = [s.key for s in self.slots if s.state is SlotState.READY and not s.in_use]
            if not candidates:
                return None
            if self.layer_quota:
                candidates = self._within_quota(key[0], candidates)
            victim = self.where[self.policy.victim(candidates, layer_now)]
            self._evict(victim)
            empty = victim
        empty.key, empty.state = key, SlotState.LOADING
        self.where[key] = empty
        self._loading[empty.index] = empty
        self._per_layer[key[0]] += 1
        return empty

    def _within_quota(self, layer: int, candidates: list[Key]) -> list[Key]:
        """Per-layer partitioning: narrow the victims to the layer's own, or to layers above quota."""
        if self._per_layer[layer] >= self.layer_quota:
            own = [k for k in candidates if k[0] == layer]
            if own:
                return own
        over = [k for k in candidates if self._per_layer[k[0]] > self.layer_quota]
        return over or candidates  # never refuse: correctness first, the quota is a preference

    def _evict(self, slot: Slot) -> None:
        assert not slot.in_use, f"evicting in-use slot {slot.index}"
        if slot.prefetched and self._stats is not None:
            self._stats().wasted_prefetches += 1
        if slot.key is not None:
            self.policy.evicted(slot.key)
            del self.where[slot.key]
            self._per_layer[slot.key[0]] -= 1
            self.evictions += 1
        slot.key, slot.state, slot.task, slot.prefetched = None, SlotState.EMPTY, None, False
        self._loading.pop(slot.index, None)

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
        if slot.prefetched:
            slot.prefetched = False
            if self._stats is not None:
                self._stats().useful_prefetches += 1

    def release(self, slot: Slot, fence: Handle) -> None:
        """The reader is done issuing its compute; ``fence`` completes when that compute has run."""
        assert slot.pins > 0, f"releasing slot {slot.index} that is not in use"
        slot.pins -= 1
        slot.fences = [fence]  # earlier fences precede this compute, which waited on the slot's load
        if not self.retain and not slot.in_use and slot.state is SlotState.READY:
            self._evict(slot)

    def check(self) -> None:
        """Internal consistency (tests): the map and the slots agree."""
        for key, slot in self.where.items():
            assert slot.key == key and slot.state is not SlotState.EMPTY, (key, slot)
        for slot in self.slots:
            assert (slot.key is None) == (slot.state is SlotState.EMPTY), slot
            assert (slot.task is not None) == (slot.state is SlotState.LOADING), slot
            assert (slot.index in self._loading) == (slot.state is SlotState.LOADING), slot
        assert +self._per_layer == Counter(k[0] for k in self.where), self._per_layer
