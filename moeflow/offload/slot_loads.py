"""The load side of :class:`moeflow.offload.backend.OffloadedExperts`: :class:`SlotLoader` gives slots to a layer's
misses, queues predicted loads for later layers, takes a prefetch's slot back for a needed load, pumps the
synchronous transport and waits until a load's bytes are visible to compute. The backend holds one (its
``loads``); a predictor that prefetches outside ``forward`` is bound to it (:class:`PrefetchTarget`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moeflow.offload.cache import ExpertCache, Slot
from moeflow.offload.contracts import LoadQueue
from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.host_store import HostStore
from moeflow.offload.policies.spec import Mechanisms
from moeflow.offload.predictors.interface import Predictor
from moeflow.offload.prefetch_gate import PrefetchGate, queued_bytes
from moeflow.offload.stats import PhaseStats, Stats
from moeflow.offload.transport import Transport


class SlotLoader:
    """Loads into the slot pool, high priority (a layer's misses) and low (predictions).

    cache: the slot cache the loads go into; engine: the copy queue that moves them; host: the experts' host
    store (the disk tier stages a guess there first); transport: the copies' completions (the compute stream's
    wait); stats: the counters (its ``phase`` decides whether ``prefill_ring`` applies); predictor: the policy's,
    asked for late proposals and queue priorities; clock: seconds, for the stall counter; prefill_ring: in prefill
    at most this many of a layer's loads hold slots at once (DuoServe), None: no limit; num_layers: the layers
    a prefetch's distance wraps around; mechanisms: the policy's switches (refresh on prefetch, ranked queue);
    gate: the bandwidth-aware prefetch gate (``Mechanisms.prefetch_gate``), None: every guess a slot can take.
    """

    def __init__(self, cache: ExpertCache, engine: LoadQueue, host: HostStore, transport: Transport, stats: Stats,
                 *, predictor: Predictor | None, clock: Callable[[], float], prefill_ring: int | None,
                 num_layers: int, mechanisms: Mechanisms, gate: PrefetchGate | None = None) -> None:
        self.cache = cache
        self.engine = engine
        self.host = host
        self.transport = transport
        self.stats = stats
        self.predictor = predictor
        self.clock = clock
        self.prefill_ring = prefill_ring
        self.num_layers = num_layers
        self.mechanisms = mechanisms
        self.gate = gate

    def warm_fill(self, count: int, num_layers: int) -> None:
        """At load: fill ``count`` slots (expert 0 of every layer, then 1, ...: every layer gets a share) and wait
        until they landed."""
        for i in range(count):
            key = (i % num_layers, i // num_layers)
            slot = self.cache.allocate(key, layer_now=0)
            task = self.engine.submit(key[0], key[1], slot.index, high=True)
            self.cache.start_load(slot, task, prefetched=False)
        self.engine.pump()
        for slot in self.cache.slots:
            if slot.task is not None:
                self.engine.wait_issued(slot.task)
                for h in slot.task.handles:
                    h.synchronize()
                self.cache.mark_ready(slot)

    def late_prefetch(self, layer: int, deferred: deque[int], st: PhaseStats) -> bool:
        """DuoServe's second synchronisation point: after an expert group, poll the prediction made beside it
        (never wait); once it landed, queue its prefetches. Returns whether to poll again."""
        proposals = self.predictor.collect_proposals(layer)  # host lists whose copy completed
        if not proposals:
            return True
        if not deferred:
            for target, ids in proposals:
                self.prefetch_guesses(target, [e for e in ids if e >= 0], layer, st)
        self.pump(st)
        return False

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> list[int]:
        """Queue low-priority loads of ``target``'s ``experts`` outside ``forward`` (e.g. FineMoE's guesses for
        the first layers, made from the token embeddings before layer 0 runs); best effort, as in step 4. Returns
        the experts queued."""
        st = self.stats.current()
        self.cache.poll()
        queued = self.prefetch_guesses(target, list(experts), layer_now, st)
        self.pump(st)
        return queued

    def load_deferred(self, layer: int, deferred: deque[int], waiting: list[LoadTask], st: PhaseStats) -> None:
        """Give the deferred experts of ``layer`` slots, while slots can be had, and queue their loads (high)."""
        ring = self.prefill_ring if self.stats.phase == "prefill" else None
        while deferred:
            if ring and len(waiting) >= ring:
                return  # the ring is full: the next load waits for a computed expert's slot
            key = (layer, deferred[0])
            slot = self.cache.allocate(key, layer)
            if slot is None:
                slot = self.reclaim_prefetch_slot(layer, key)
            if slot is None:
                return
            deferred.popleft()
            task = self._submit(slot, layer, key[1], high=True, stats=st)
            self.cache.start_load(slot, task, prefetched=False)
            self.cache.use(slot)
            waiting.append(task)

    def _submit(self, slot: Slot, layer: int, expert: int, *, high: bool, stats: PhaseStats,
                priority: float = 0.0) -> LoadTask:
        """The copy into ``slot`` (just allocated); when it cannot start (the disk tier's read of the expert
        failed: a CheckpointError naming the file) the slot is empty again and the error propagates, so the
        next request that needs the expert tries again."""
        fences = self.cache.take_fences(slot)
        try:
            return self.engine.submit(layer, expert, slot.index, high=high, after=fences, stats=stats,
                                      priority=priority)
        except BaseException:
            self.cache.drop(slot, fences)
            raise

    def reclaim_prefetch_slot(self, layer: int, key: tuple[int, int]) -> Slot | None:
        """No free slot: cancel the prefetch for the farthest layer ahead and take its slot."""
        loading = self.cache.loading_unused()
        if not loading:
            return None
        victim = max(loading, key=lambda s: ((s.key[0] - layer) % self.num_layers, s.index))
        if victim.task.complete():
            self.cache.mark_ready(victim)
        else:
            self.cache.drop(victim, self.engine.cancel(victim.task))
        return self.cache.allocate(key, layer)

    def layer_gate(self, layer: int, needed: list[int]) -> None:
        """Layer ``layer``'s routing is known: the prefetch gate counts its guesses' outcomes and the layer period."""
        if self.gate is not None:
            self.gate.layer_gate(layer, needed, self.stats.phase)

    def prefetch_guesses(self, target: int, experts: list[int], layer: int, st: PhaseStats) -> list[int]:
        """Queue low-priority loads of ``target``'s ``experts`` (most wanted first) not cached yet, while a slot is
        free (never cancelling another load for a guess) and, with the prefetch gate, where it admits them. Returns
        the experts queued."""
        refresh = self.mechanisms.refresh_on_prefetch
        ranked = self.mechanisms.queue_priority and self.predictor is not None
        gate, phase = self.gate, self.stats.phase
        if gate is not None:
            gate.record(target, experts, phase)
            backlog = queued_bytes(self.engine)
        queued: list[int] = []
        for rank, e in enumerate(experts):
            key = (target, e)
            if self.cache.lookup(key) is not None:
                if refresh:  # ProMoE's per-layer LRU: the prediction touches the cached expert
                    self.cache.policy.refreshed(key)
                continue
            if gate is not None:
                if not gate.admit(target, rank, layer, backlog, phase):
                    st.gated_prefetches += 1
                    continue
                backlog += self.host.fmt.nbytes
            if not self.host.stage(target, e):
                continue  # disk tier: a guess not in host memory is read from disk now, copied when needed
            slot = self.cache.allocate(key, layer)
            if slot is None:
                return queued  # best effort: never cancel other loads for a guess
            priority = self.predictor.queue_priority(target, e, layer) if ranked else 0.0
            task = self._submit(slot, target, e, high=False, stats=st, priority=priority)
            self.cache.start_load(slot, task, prefetched=True)
            st.prefetches += 1
            queued.append(e)
        return queued

    def pump(self, st: PhaseStats) -> None:
        """Synchronous transport: the copies happen here, on the critical path (counted as stall)."""
        if self.engine.threaded:
            return
        t0 = self.clock()
        self.engine.pump()
        st.stall_s += self.clock() - t0

    def release_unread(self, task: LoadTask) -> None:
        """Hybrid race won by the CPU: unpin the slot unread and cancel the load's chunks not yet issued (left queued
        they would hold the link at high priority, ahead of the next layers' loads and prefetches); the slot is
        empty again once the chunks already issued have landed (``cache.drop`` behind the load's fences). A load
        fully issued already carries on and caches the expert."""
        slot = self.cache.lookup(task.key)
        self.cache.release(slot, self.transport.compute_fence())
        if not task.issued:
            self.cache.drop(slot, self.engine.cancel(task))
            self.stats.current().cpu_race_cancels += 1

    def synchronize(self) -> None:
        """Wait for every queued and in-flight copy."""
        for task in self.engine.pending():
            self.engine.wait_issued(task)
        self.transport.synchronize()

    def wait(self, task: LoadTask, st: PhaseStats) -> None:
        """Compute from now on sees ``task``'s bytes (host wait for issue, device-side wait for the copy)."""
        t0 = self.clock()
        self.engine.wait_issued(task)
        self.transport.wait_compute(task.handles)
        st.stall_s += self.clock() - t0
        self.cache.mark_ready(self.cache.lookup(task.key))
