"""The host tier over the disk: at most ``capacity`` experts in (pinned) host rows, read from the checkpoint.

:class:`DiskHostStore` has :class:`~moeflow.offload.host_store.HostStore`'s interface (``buffer``, ``index``,
``region``, ``cpu_expert``, ``fmt``, ``pinned``, ``close``), so the copy engine and the backend use it unchanged;
``index(layer, expert)`` is the row the expert sits in *now*. Rows change hands under its own eviction policy.

Who keeps a row in place: an ``acquire`` (the backend is about to submit a device copy from it) pins it,
``hold(task)`` hands the pin to the copy task, which keeps the row until every chunk has landed (or the task
was cancelled and its issued chunks landed). A read in flight keeps its row too. Any other row may be evicted.

Reads run on a pool of reader threads (``readers``), each with its own staging buffer
(:meth:`moeflow.io.expert_index.ExpertIndex.read`): demand reads (``acquire``, ``stage_all``) before prefetch
reads (``stage``). A read that fails frees its row and the error reaches whoever acquires that expert; the row
is only marked ready after the whole expert was converted into it, so nothing half-read is ever copied.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.formats import ExpertFormat
from moeflow.offload.eviction import EvictionPolicy, Key
from moeflow.offload.host_store import HostStore

log = logging.getLogger(__name__)

FREE, READING, READY = "free", "reading", "ready"
HIGH, LOW, FILL = 0, 1, 2  # demand reads, then prefetches, then the background fill (OffloadConfig.background_load)


class RowEngine(Protocol):
    """The copy engine as the store sees it, to free a row held by its copies (the part of
    :class:`moeflow.offload.contracts.LoadQueue` it uses; the copy engine's stats import this module).
    ``wait_issued(task)``: block until every chunk of the copy task was handed to the transport."""

    threaded: bool

    def pump(self, max_chunks: int | None = None) -> int: ...

    def wait_issued(self, task) -> None: ...  # task: a LoadTask (copy_engine.py imports this module, via stats)



@dataclass
class DiskStats:
    """``backend.host.stats`` of the disk tier (``model.stats.disk`` points at it)."""

    bytes_read: int = 0  # checkpoint bytes read for experts (demand, prefetch and warm fill)
    load_bytes_read: int = 0  # of those, read while loading (the warm fill)
    reads: int = 0
    demand_reads: int = 0  # experts read after their layer's gate asked for them (after load)
    prefetch_reads: int = 0  # experts read ahead of their gate (a predictor's guesses)
    fill_reads: int = 0  # experts queued by the background fill (OffloadConfig.background_load)
    hits: int = 0  # acquires that found the expert in host memory
    misses: int = 0  # acquires that had to wait for a read
    stall_s: float = 0.0  # time the compute thread waited on disk reads (and on rows to free)
    read_s: float = 0.0  # reader-thread seconds spent reading and converting
    evictions: int = 0
    failed_reads: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def reset(self) -> None:
        """Zero every counter in place (``model.stats.reset()``; the store and ``model.stats.disk`` share it)."""
        for f in fields(self):
            setattr(self, f.name, f.default)


class DiskHostStore(HostStore):
    """``uint8 [capacity, fmt.nbytes]`` host rows caching experts of ``source`` (an ``ExpertIndex``).

    eviction: the tier's own policy (fed with ``access`` on every acquire, ``loaded`` on every read).
    readers: reader threads; clock: the clock stalls are measured with.
    """

    on_disk = True

    def __init__(self, fmt: ExpertFormat, source, capacity: int, eviction: EvictionPolicy, *, pin: bool,
                 device: torch.device | str, readers: int = 2, clock: Callable[[], float] = time.perf_counter):
        if capacity < 1:
            raise ValueError(f"a disk-backed host store needs at least one row, got {capacity}")
        self.fmt = fmt
        self.source = source
        self.num_layers, self.num_experts = source.num_layers, source.num_experts
        self.capacity = capacity
        shape = (capacity, fmt.nbytes)  # (the CPU kernels read it on device="cpu": on huge pages, as HostStore's)
        self.buffer = hugepages.empty(shape, torch.uint8) if torch.device(device).type == "cpu" else \
            torch.empty(shape, dtype=torch.uint8)
        self.pinned, self._registered_ptr = False, None
        if pin and torch.device(device).type == "cuda":
            self._pin()
        self.policy = eviction
        self.stats = DiskStats()
        self.clock = clock
        self.loading = True  # reads count as load_bytes_read until ``finish_warm_fill``
        self._gaps = HostStore._alignment_gaps(fmt)
        self._cond = threading.Condition()
        self._row_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * capacity
        self._state = [FREE] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # free rows, row 0 on top
        self._pins = [0] * capacity
        self._holds: list[list] = [[] for _ in range(capacity)]  # copy tasks reading the row
        # failed reads: (failure number, error), delivered to the acquires that began before it (a later one
        # reads the expert afresh: an error never outlives the requests it failed)
        self._errors: dict[Key, tuple[int, BaseException]] = {}
        self._failures = 0
        self._cpu_forms: dict[Key, object] = {}
        self._queue: list[tuple[int, int, Key, int]] = []  # (priority, order, key, row)
        self._order = 0
        self._closed = False
        self.engine: RowEngine | None = None  # the copy engine whose tasks hold rows (``bind_engine``)
        self._threads = [threading.Thread(target=self._reader, args=(source.new_staging(),), daemon=True,
                                          name=f"moeflow-disk-reader-{i}") for i in range(max(1, readers))]
        for t in self._threads:
            t.start()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def staging_nbytes(self) -> int:
        return len(self._threads) * self.source.staging_nbytes

    def bind_engine(self, engine: RowEngine) -> None:
        """The copy engine whose queued tasks may have to be issued before a held row frees up."""
        self.engine = engine

    # ------------------------------------------------------------------ the copy engine's view
    def index(self, layer: int, expert: int) -> int:
        row = self._row_of.get((layer, expert))
        if row is None or self._state[row] != READY:
            raise RuntimeError(f"expert ({layer}, {expert}) is not in the host cache: acquire it before copying")
        return row

    def region(self, layer: int, expert: int) -> torch.Tensor:
        return self.buffer[self.index(layer, expert)]

    def write(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("a disk-backed host store reads its experts itself; nothing is loaded into it")

    def missing(self) -> list[tuple[int, int]]:
        return []  # every expert is on disk (the index checked its tensors at load)

    def resident(self) -> list[Key]:
        with self._cond:
            return [k for k, r in self._row_of.items() if self._state[r] == READY]

    # ------------------------------------------------------------------ the backend's view
    def stage(self, layer: int, expert: int) -> bool:
        """Prefetch path: True when the expert is in host memory now; else start reading it (best effort:
        only into a row that can be had without waiting) and return False."""
        key = (layer, expert)
        with self._cond:
            row = self._row_of.get(key)
            if row is not None:
                return self._state[row] == READY
            self._start_read(key, LOW)
            return False

    def stage_all(self, layer: int, experts) -> None:
        """A layer's misses: start reading all of them at once (demand priority), as far as rows allow."""
        with self._cond:
            for e in experts:
                if (layer, e) not in self._row_of:
                    if self._start_read((layer, e), HIGH) is None:
                        return
                elif self._state[self._row_of[(layer, e)]] == READING:
                    self._bump((layer, e))  # queued by the background fill: needed now

    def acquire(self, layer: int, expert: int) -> int:
        """Block until the expert is in host memory and pin its row (released by :meth:`hold` or :meth:`release`)."""
        key = (layer, expert)
        t0 = self.clock()
        waited = False
        with self._cond:
            self.policy.access(key)
            began = self._failures
            while True:
                if key in self._errors:
                    failure, exc = self._errors.pop(key)
                    if failure > began:
                        raise exc
                    continue  # an earlier request's failure: read it again
                row = self._row_of.get(key)
                if row is not None and self._state[row] == READY:
                    self._pins[row] += 1
                    break
                waited = True
                if row is None:
                    if self._start_read(key, HIGH) is None:
                        self._cond.release()
                        try:
                            self._free_a_row()
                        finally:
                            self._cond.acquire()
                        continue
                else:
                    self._bump(key)
                self._cond.wait(timeout=0.5)
            if waited:
                self.stats.misses += 1
                if not self.loading:
                    self.stats.stall_s += self.clock() - t0
            else:
                self.stats.hits += 1
        return row

    def hold(self, task) -> None:
        """``task`` (a copy from the expert's row, just submitted) keeps the row the acquire pinned."""
        with self._cond:
            row = self._row_of[task.key]
            self._pins[row] -= 1
            self._holds[row].append(task)

    def release(self, layer: int, expert: int) -> None:
        """Unpin a row acquired but not handed to a copy."""
        with self._cond:
            self._pins[self._row_of[(layer, expert)]] -= 1
            self._cond.notify_all()

    def cpu_expert(self, layer: int, expert: int):
        """The expert's CPU form (hybrid execution, its format's ``cpu_expert``). A
        resident expert's form is kept while its row is;
        one not in host memory is read into a private buffer (no row: a CPU worker never waits for rows)."""
        from moeflow.offload.cpu_slots import CpuInt4Format, int4_expert_of

        key = (layer, expert)
        with self._cond:
            form = self._cpu_forms.get(key)
            row = self._row_of.get(key)
            if form is not None:
                return form
            if row is not None and self._state[row] == READY:
                self._pins[row] += 1
            else:
                row = None
        if row is None:
            tensors = self.source.read(layer, expert, self.source.new_staging())
            with self._cond:
                self.stats.bytes_read += self.source.nbytes(layer, expert)
                self.stats.reads += 1
                self.stats.demand_reads += 1
            return self.fmt.cpu_expert(tensors)
        form = None
        try:
            if isinstance(self.fmt, CpuInt4Format):
                form = int4_expert_of(self.fmt, self.buffer[row], own=True)  # kept after the row is reused
            else:  # views of a private copy of the row where the kernels read the stored layout (GGUF, MXFP4)
                form = self.fmt.cpu_region_expert(self.buffer[row].clone())
                if form is None:
                    form = self.fmt.cpu_expert(self.fmt.loader_tensors(self.buffer[row]))
        finally:
            with self._cond:
                self._pins[row] -= 1
                if form is not None and self._key_of[row] == key:
                    self._cpu_forms[key] = form
                self._cond.notify_all()
        return form

    @property
    def cpu_nbytes(self) -> int:
        return sum(f.nbytes for f in list(self._cpu_forms.values()))

    def warm_fill(self, keys: list[Key]) -> None:
        """Read ``keys`` (at most ``capacity``) at load, in parallel, and wait for them."""
        keys = keys[: self.capacity]
        with self._cond:
            for key in keys:
                if key not in self._row_of:
                    self._start_read(key, HIGH)
            while any(self._row_of.get(k) is not None and self._state[self._row_of[k]] == READING for k in keys):
                self._cond.wait(timeout=0.5)
            for key in keys:
                if key in self._errors:
                    raise self._errors.pop(key)[1]

    def background_fill(self, keys: list[Key]) -> None:
        """Queue ``keys`` (at most ``capacity``) for reading behind every demand and prefetch read, and return at
        once: the background fill of ``OffloadConfig.background_load``. A key acquired before its turn is read
        at demand priority; a failed read fails only the acquires of its expert (and is read again on the next)."""
        with self._cond:
            for key in keys[: self.capacity]:
                if key not in self._row_of and self._start_read(key, FILL) is None:
                    break

    def filled(self) -> bool:
        """Whether no read is queued or running (the background fill, if any, is done)."""
        with self._cond:
            return not self._queue and READING not in self._state

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Block until :meth:`filled` (or ``timeout`` seconds); returns whether it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or READING in self._state:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=0.5 if left is None else min(left, 0.5))
        return True

    def finish_warm_fill(self) -> None:
        self.loading = False

    # ------------------------------------------------------------------ rows (lock held)
    def _start_read(self, key: Key, priority: int) -> int | None:
        row = self._take_row(key)
        if row is None:
            return None
        self._key_of[row], self._state[row] = key, READING
        self._row_of[key] = row
        self._order += 1
        heapq.heappush(self._queue, (priority, self._order, key, row))
        if priority == LOW:
            self.stats.prefetch_reads += 1
        elif priority == FILL:
            self.stats.fill_reads += 1
        elif not self.loading:
            self.stats.demand_reads += 1
        self._cond.notify_all()
        return row

    def _bump(self, key: Key) -> None:
        """A queued prefetch or fill read is needed now: move it to the demand priority."""
        for i, (prio, order, k, row) in enumerate(self._queue):
            if k == key and prio != HIGH:
                self._queue[i] = (HIGH, order, k, row)
                heapq.heapify(self._queue)
                return

    def _row_free(self, row: int) -> bool:
        if self._state[row] != READY or self._pins[row]:
            return False
        self._holds[row] = [t for t in self._holds[row] if not _task_done(t)]
        return not self._holds[row]

    def _take_row(self, key: Key) -> int | None:
        """A free row, else the policy's victim among rows nobody uses; None when every row is in use."""
        if self._free:
            return self._free.pop()
        candidates = [self._key_of[r] for r in range(self.capacity) if self._row_free(r)]
        if not candidates:
            return None
        victim = self.policy.victim(candidates, key[0])
        row = self._row_of.pop(victim)
        self.policy.evicted(victim)
        self._cpu_forms.pop(victim, None)
        self._key_of[row], self._state[row] = None, FREE
        self.stats.evictions += 1
        return row

    def _free_a_row(self) -> None:
        """Every row is read into or copied from: let the oldest holder finish (without the store's lock)."""
        with self._cond:
            tasks = [t for r in range(self.capacity) for t in self._holds[r] if not _task_done(t)]
            reading = any(s == READING for s in self._state)
        engine = self.engine
        if engine is not None and not engine.threaded:
            engine.pump()  # synchronous copies: issuing them is what frees their rows
            return
        for task in tasks:
            if not task.cancelled and not task.issued and engine is not None:
                engine.wait_issued(task)
            for h in task.handles:
                h.synchronize()
            return
        with self._cond:  # rows pinned for a moment (a CPU form being built) or being read: wait for them
            self._cond.wait(timeout=0.05 if reading else 0.01)

    # ------------------------------------------------------------------ reader threads
    def _reader(self, staging: torch.Tensor) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                priority, _, key, row = heapq.heappop(self._queue)
            t0 = time.perf_counter()
            try:
                tensors = self.source.read(key[0], key[1], staging)
                self.fmt.write(self.buffer[row], tensors)
                for a, b in self._gaps:
                    self.buffer[row, a:b].zero_()
            except BaseException as exc:  # surfaced to whoever acquires the expert
                with self._cond:
                    self._row_of.pop(key, None)
                    self._key_of[row], self._state[row] = None, FREE
                    self._free.append(row)
                    if priority == FILL:  # nobody waits for it: the next acquire reads the expert afresh
                        log.warning("moeflow: background fill: %s (read again when a request needs it)", exc)
                    else:
                        self._failures += 1
                        self._errors[key] = (self._failures, exc)
                    self.stats.failed_reads += 1
                    self._cond.notify_all()
                continue
            n = self.source.nbytes(*key)
            with self._cond:
                self._state[row] = READY
                self.policy.loaded(key)
                self.stats.reads += 1
                self.stats.bytes_read += n
                self.stats.read_s += time.perf_counter() - t0
                if self.loading:
                    self.stats.load_bytes_read += n
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)
        self.source.close()
        super().close()


def _task_done(task) -> bool:
    """A copy task no longer reads its host row: every issued chunk landed and no more will be issued."""
    if not (task.cancelled or task.issued):
        return False
    return all(h.query() for h in task.handles)
