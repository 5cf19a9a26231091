"""The copy engine: a two-priority queue of chunked expert loads, drained into a :class:`Transport`.

ProMoE §5, with one worker:

* **two priorities**: high = needed by the layer being computed (known at its gate), low = predicted.
  The worker always takes the next chunk of the oldest high task before any low chunk.
* **chunked**: an expert load is split into ``chunks`` byte ranges of its region (ProMoE: one per
  matrix); a predicted (low) load also into pieces of at most ``PREFETCH_CHUNK_BYTES``. Only
  ``max_inflight`` chunks sit in the transport at once while low work is issued, so a high task that
  arrives waits for at most that many small chunks, not for whole experts already queued on the stream;
  high chunks are never held back by that cap (a needed load is issued as soon as it is queued).
* **early preemption**: :meth:`CopyEngine.preempt` is called with a layer's gate result; that layer's
  low tasks for experts it does not need are dropped (their unissued chunks never move), the ones it
  does need are promoted to the high queue.
* **batched issue** (many small experts, issue 16): when the transport has ``copy_batch``, one issue of
  needed (high) work takes the head task's chunks and then whole high tasks behind it, up to ``batch_bytes``
  (a layer's misses), and hands them over as one batch: chunks adjacent in both the host store and the pool
  become one copy (an expert's chunks, one ``cudaMemcpyAsync``), and the batch completes on one handle (one
  CUDA event) waiting on the union of its tasks' ``after``. Predicted (low) work stays one chunk per issue:
  a needed load still waits behind at most ``max_inflight`` small chunks. Transports without ``copy_batch``
  (the simulator's, the scripted test transport) get one chunk per issue for everything, as before.
* **copies outside the queue lock**: chunks are claimed under the lock (``LoadTask.in_transit``), handed
  to the transport without it (a pageable-memory copy blocks for its whole length; ``submit`` and
  ``promote`` from the compute thread must not wait for that), and their handle attached under it again.
  A task with chunks in transit is not ``issued``; ``cancel`` and ``preempt`` wait for the handle, so the
  fences they return are complete.

With an asynchronous transport (CUDA stream, random-delay test transport) a daemon worker thread
issues chunks as soon as they are queued. With the synchronous transport there is no thread: chunks
are issued by :meth:`CopyEngine.pump` at the points the caller chooses, so CPU runs are deterministic.
Either way the same queue code decides what moves next.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from moeflow.kernels.pool import ExpertPool
from moeflow.offload.chunks import chunk_ranges, linear_chunks
from moeflow.offload.host_store import HostStore
from moeflow.offload.stats import PhaseStats
from moeflow.offload.transport import BatchCopies, Handle, Transport

PREFETCH_CHUNK_BYTES = 8 * 2**20  # a needed load waits behind at most ~one such piece of a prefetch
__all__ = ["BATCH_BYTES", "PREFETCH_CHUNK_BYTES", "CopyEngine", "LoadTask", "chunk_ranges", "linear_chunks"]
BATCH_BYTES = PREFETCH_CHUNK_BYTES  # one issue of needed loads gathers up to this many bytes (copy_batch transports)


@dataclass(eq=False, slots=True)
class LoadTask:
    """Copy of one expert's host region into one device slot, in chunks."""

    layer: int
    expert: int
    slot: int
    high: bool
    chunks: Sequence[tuple[int, int]]  # adjacent byte ranges covering the region (shared by tasks, never changed)
    after: tuple[Handle, ...] = ()  # writes into / reads of the slot that must finish first
    stats: PhaseStats | None = None  # where the moved bytes are counted (the phase at submit time)
    priority: float = 0.0  # low queue order: larger first (predictor score hook)
    order: int = 0  # position in the queue it last entered (arrival order for reordered inference)
    next_chunk: int = 0
    handles: list[Handle] = field(default_factory=list)
    cancelled: bool = False
    in_transit: int = 0  # chunks claimed by the issuer whose handle is not attached yet (copy call under way)

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)

    @property
    def issued(self) -> bool:
        """Every chunk handed to the transport (and its handle attached)."""
        return self.next_chunk == len(self.chunks) and self.in_transit == 0

    def complete(self) -> bool:
        """Every chunk issued and landed."""
        if self.next_chunk != len(self.chunks) or self.in_transit or self.cancelled:
            return False
        for h in self.handles:
            if not h.query():
                return False
        return True

    def fences(self) -> list[Handle]:
        """What a later write into the same slot must wait for (this task's copies, and what they waited for)."""
        return [h for h in (*self.after, *self.handles) if not h.query()]


class CopyEngine:
    """Two-priority chunk queue in front of a transport; see the module docstring.

    batch_bytes: most bytes one issue hands the transport (``copy_batch`` transports only); 0: one chunk per
    issue. Counters: ``tasks`` submitted, ``copies`` (copy operations handed to the transport), ``batches``
    (transport calls, each with one completion handle: a CUDA event).
    """

    def __init__(
        self,
        transport: Transport,
        host: HostStore,
        pool: ExpertPool,
        *,
        chunks: int = 3,
        max_inflight: int = 2,
        threaded: bool | None = None,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        if host.fmt.nbytes != pool.fmt.nbytes:
            raise ValueError("host store and slot pool use different expert formats")
        self.transport = transport
        self.host = host
        self.pool = pool
        self.chunks = tuple(chunk_ranges(pool.fmt.nbytes, chunks))
        self.low_chunks = tuple(chunk_ranges(pool.fmt.nbytes, max(chunks, -(-pool.fmt.nbytes // PREFETCH_CHUNK_BYTES))))
        self.max_inflight = max_inflight
        self.threaded = transport.asynchronous if threaded is None else threaded
        # batch_bytes=0 or a transport without copy_batch (not BatchCopies): one chunk per issue through transport.copy
        self._copy_batch = transport.copy_batch if batch_bytes > 0 and isinstance(transport, BatchCopies) else None
        self.batch_bytes = batch_bytes if self._copy_batch is not None else 0
        self._flat: tuple | None = None  # flat views of the host buffer and the pool (first batched copy)
        self._rows: tuple[list, list] = ([], [])  # row views of both, the host's made on first use
        self._high: deque[LoadTask] = deque()
        self._low: list[LoadTask] = []  # sorted: priority descending, then order
        self._cond = threading.Condition()
        self._order = 0
        self._inflight: deque[Handle] = deque()  # touched only by whoever issues (worker or pump)
        self._closed = False
        self._error: BaseException | None = None
        self.cancelled_chunks = 0  # chunks that never moved because their task was dropped
        self.tasks = self.copies = self.batches = 0
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._worker, name="moeflow-copy-engine", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- queue operations (caller thread)
    def submit(
        self,
        layer: int,
        expert: int,
        slot: int,
        *,
        high: bool,
        after: Sequence[Handle] = (),
        stats: PhaseStats | None = None,
        priority: float = 0.0,
    ) -> LoadTask:
        """Queue the load of expert (layer, expert) into ``slot``."""
        task = LoadTask(layer, expert, slot, high, self.chunks if high else self.low_chunks, tuple(after), stats,
                        priority)
        with self._cond:
            self._raise_if_failed()
            self._enqueue(task)
            self.tasks += 1
            self._cond.notify_all()
        return task

    def set_low_chunks(self, chunks: Sequence[tuple[int, int]]) -> None:
        """Cut predicted (low) loads submitted from now on into ``chunks`` (adjacent byte ranges covering an expert
        region, e.g. :func:`linear_chunks`) instead of the equal pieces of at most ``PREFETCH_CHUNK_BYTES``."""
        chunks = tuple((int(a), int(b)) for a, b in chunks)
        edges = [c for ab in chunks for c in ab]
        nbytes = self.pool.fmt.nbytes
        if not chunks or edges[0] != 0 or edges[-1] != nbytes or any(
                b <= a for a, b in chunks) or any(chunks[i][1] != chunks[i + 1][0] for i in range(len(chunks) - 1)):
            raise ValueError(f"low chunks {chunks} are not adjacent non-empty ranges covering [0, {nbytes})")
        self.low_chunks = chunks

    def _enqueue(self, task: LoadTask) -> None:
        self._order += 1
        task.order = self._order
        if task.high:
            self._high.append(task)
            return
        i = len(self._low)
        while i > 0 and self._low[i - 1].priority < task.priority:
            i -= 1
        self._low.insert(i, task)

    def promote(self, task: LoadTask) -> None:
        """A predicted expert turned out to be needed now: its remaining chunks jump the queue."""
        with self._cond:
            if task.high or task.cancelled:
                return
            task.high = True
            if task in self._low:
                self._low.remove(task)
                self._enqueue(task)
            self._cond.notify_all()

    def cancel(self, task: LoadTask) -> list[Handle]:
        """Drop the task's unissued chunks; returns what a later write into its slot must wait for."""
        with self._cond:
            if not task.cancelled:
                task.cancelled = True
                self.cancelled_chunks += len(task.chunks) - task.next_chunk
                if task in self._low:
                    self._low.remove(task)
                elif task in self._high:
                    self._high.remove(task)
            self._await_transit([task])
            return task.fences()

    def preempt(self, layer: int, needed: set[int]) -> tuple[list[LoadTask], list[LoadTask]]:
        """Gate result of ``layer`` is known: promote its low tasks in ``needed``, drop the others.

        Returns (promoted, dropped). Tasks already fully issued are left alone (their bytes are moving).
        A dropped task's chunks in transit have their handles attached before this returns (its fences).
        """
        promoted, dropped = [], []
        with self._cond:
            if not self._low:  # nothing predicted is queued (every all-hit layer, every policy without a predictor)
                self._raise_if_failed()
                return promoted, dropped
            for task in [t for t in self._low if t.layer == layer]:
                self._low.remove(task)
                if task.expert in needed:
                    task.high = True
                    self._enqueue(task)
                    promoted.append(task)
                else:
                    task.cancelled = True
                    self.cancelled_chunks += len(task.chunks) - task.next_chunk
                    dropped.append(task)
            self._cond.notify_all()
            self._await_transit(dropped)
        return promoted, dropped

    def _await_transit(self, tasks: list[LoadTask]) -> None:
        """(lock held) Wait until the issuer attached the handles of ``tasks``' claimed chunks."""
        while any(t.in_transit for t in tasks) and self._error is None:
            self._cond.wait(timeout=1.0)
        self._raise_if_failed()

    def pending(self) -> list[LoadTask]:
        """Queued tasks, in the order the worker will take them."""
        with self._cond:
            return [*self._high, *self._low]

    def head(self) -> LoadTask | None:
        """The task whose chunk goes next (None: nothing queued)."""
        with self._cond:
            return self._high[0] if self._high else (self._low[0] if self._low else None)

    def issue_next(self) -> Handle | None:
        """Issue the next batch (one chunk of :meth:`head`, or more with ``copy_batch``) now, from the caller's
        thread; returns its handle (None: nothing queued).

        For engines that replay the worker themselves (the simulator's virtual-time worker)."""
        return self._issue_next()

    def high_backlog(self) -> list[tuple[LoadTask, int]]:
        """Queued high-priority loads in the order they will land, each with its bytes still to issue."""
        with self._cond:
            return [(t, sum(hi - lo for lo, hi in t.chunks[t.next_chunk:])) for t in self._high]

    def wait_issued(self, task: LoadTask) -> None:
        """Block until every chunk of ``task`` is in the transport (issuing inline without a worker)."""
        if task.cancelled:
            raise RuntimeError(f"waiting on cancelled load of expert {task.key}")
        if not self.threaded:
            while not task.issued:
                if not self.pump(1):
                    raise RuntimeError(f"load of expert {task.key} is not queued")
            return
        with self._cond:
            while not task.issued and self._error is None and not task.cancelled:
                self._cond.wait(timeout=1.0)
            self._raise_if_failed()
            if task.cancelled and not task.issued:
                raise RuntimeError(f"load of expert {task.key} was cancelled while waited on")

    def pump(self, max_chunks: int | None = None) -> int:
        """Without a worker thread: issue up to ``max_chunks`` queued batches (all when None; a batch is one
        chunk unless the transport takes ``copy_batch``). Returns the count."""
        if self.threaded or not (self._high or self._low):
            return 0
        n = 0
        while max_chunks is None or n < max_chunks:
            if self._issue_next() is None:
                break
            n += 1
        return n

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # ----------------------------------------------------------------- issuing (worker thread or pump)
    def _claim(self) -> list[tuple[LoadTask, int, int]]:
        """(lock held) Take the next chunks off the queue: the head's next chunk; for a needed (high) head, while
        the batch stays within ``batch_bytes``, the rest of its chunks and then whole high tasks behind it. A
        prediction (low) goes one chunk per issue, so a needed load that arrives waits behind small pieces only
        and a queued prediction can still be dropped at its gate (the simulator measured that batching
        predictions costs more in needed-load latency than it saves in copies).

        Returns one piece ``(task, start, end)`` per task: the byte range of the chunks claimed from it (adjacent
        chunks, so one range)."""
        if not self._high:
            if not self._low:
                return []
            task = self._low[0]
            a, b = task.chunks[task.next_chunk]
            task.next_chunk += 1
            task.in_transit += 1
            if task.next_chunk == len(task.chunks):
                self._low.pop(0)
            return [(task, a, b)]
        pieces: list[tuple[LoadTask, int, int]] = []
        total, budget, queue_ = 0, self.batch_bytes, self._high
        while queue_:
            task = queue_[0]
            chunks, i = task.chunks, task.next_chunk
            a, end = chunks[i][0], chunks[-1][1]
            if total + (end - a) <= budget:  # the rest of the task fits: take it whole
                task.next_chunk = len(chunks)
            elif pieces:  # another task joins only whole: one copy per expert
                break
            else:  # the head alone is larger than a batch: its chunks while they fit (at least one)
                j = i + 1
                while j < len(chunks) and total + (chunks[j][1] - a) <= budget:
                    j += 1
                task.next_chunk, end = j, chunks[j - 1][1]
            pieces.append((task, a, end))
            total += end - a
            task.in_transit += 1
            if task.next_chunk < len(chunks):
                break
            queue_.popleft()
        return pieces

    def _issue_next(self) -> Handle | None:
        """Claim a batch under the lock, copy it without the lock, attach its handle under the lock."""
        with self._cond:
            pieces = self._claim()
        if not pieces:
            return None
        try:
            handle, copies = self._copy(pieces)
        except BaseException:
            with self._cond:  # the chunks never moved: release the claim so waiters see the failure, not a hang
                for task, _, _ in pieces:
                    task.in_transit -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            for task, a, b in pieces:
                if not task.handles or task.handles[-1] is not handle:
                    task.handles.append(handle)
                task.in_transit -= 1
                if task.stats is not None:
                    task.stats.bytes_h2d += b - a
            stats = pieces[0][0].stats
            if stats is not None:
                stats.copies += copies
                stats.copy_batches += 1
            self.copies += copies
            self.batches += 1
            self._cond.notify_all()
        if self.threaded:
            self._inflight.append(handle)
        return handle

    def _copy(self, pieces: list[tuple[LoadTask, int, int]]) -> tuple[Handle, int]:
        """Hand the claimed chunks to the transport (no lock held); returns (handle, copy operations)."""
        if self._copy_batch is None:  # one chunk per issue; every chunk waits on the fences (out-of-order transports)
            task, a, b = pieces[0]
            src = self.host.buffer[self.host.index(task.layer, task.expert), a:b]
            return self.transport.copy(self.pool.buffer[task.slot, a:b], src, task.after), 1
        nbytes = self.pool.fmt.nbytes
        if self._flat is None:  # both buffers are allocated once, with their owners
            self._flat = (self.host.buffer.view(-1), self.pool.buffer.view(-1))
            self._rows = ([None] * self.host.buffer.shape[0], list(self.pool.buffer))
        # [src_start, dst_start, length, host row, slot]: runs adjacent in the store and in the pool; the row and
        # the slot while the run is one whole expert (its row views, kept: no slicing per copy)
        spans: list[list[int]] = []
        after: dict[int, Handle] = {}
        index = self.host.index
        for task, a, b in pieces:
            row = index(task.layer, task.expert)
            src, dst = row * nbytes + a, task.slot * nbytes + a
            if spans and spans[-1][0] + spans[-1][2] == src and spans[-1][1] + spans[-1][2] == dst:
                spans[-1][2] += b - a
                spans[-1][3] = -1
            else:
                spans.append([src, dst, b - a, row if b - a == nbytes else -1, task.slot])
            for h in task.after:
                after.setdefault(id(h), h)
        host_flat, pool_flat = self._flat
        host_rows, pool_rows = self._rows
        pairs = []
        for s, d, n, row, slot in spans:
            if row < 0:
                pairs.append((pool_flat[d:d + n], host_flat[s:s + n]))
                continue
            src = host_rows[row]
            if src is None:
                src = host_rows[row] = self.host.buffer[row]
            pairs.append((pool_rows[slot], src))
        return self._copy_batch(pairs, tuple(after.values())), len(pairs)

    def _throttle(self) -> None:
        """Keep at most ``max_inflight`` batches in the transport, so the queue stays preemptible."""
        while self._inflight and self._inflight[0].query():
            self._inflight.popleft()
        while len(self._inflight) >= self.max_inflight:
            self._inflight.popleft().synchronize()

    def _worker(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._high or self._low) and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                    high = bool(self._high)
                if not high:  # only prefetches are held back; outside the lock: submit must not wait
                    self._throttle()
                self._issue_next()  # chooses after the wait: a high task that arrived meanwhile goes first
        except BaseException as exc:  # surfaced to the compute thread at its next wait
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("moeflow copy engine worker failed") from self._error
