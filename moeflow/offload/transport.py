"""How bytes move from the host store into device slots, and how compute waits for them.

A :class:`Transport` turns ``dst.copy_(src)`` into an asynchronous operation with a completion
:class:`Handle`. The scheduler above it is the same for every transport:

* :class:`CudaTransport`: copies on a dedicated side stream, completion = CUDA event; compute waits
  with ``stream.wait_event`` (a device-side wait, never a device-wide synchronize).
* :class:`SyncTransport`: the copy happens on the spot (CPU, or debugging); every handle is done.
* :class:`RandomDelayTransport`: a test transport. Background threads perform each copy after a random
  delay, so copies complete late and out of order; completion = ``threading.Event``. Any missing wait
  in the scheduler shows up as wrong numbers on the CPU.

Two kinds of ordering matter and every transport honours both:

* ``after``: a copy into a slot starts only after the given handles completed (an earlier, cancelled
  copy into the same slot, or the compute that last read the slot: see :meth:`Transport.compute_fence`).
* :meth:`Transport.wait_compute`: compute issued after this call sees the copy's bytes.

``copy_batch`` (optional, :class:`BatchCopies`; the copy engine batches chunks only where a transport has it):
several copies that start after the union of their fences and complete on one handle: one CUDA event for several
``cudaMemcpyAsync`` (many small experts, issue 16).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from moeflow.kernels.workspace import current_stream_handle


class Handle(Protocol):
    """Completion of one asynchronous operation."""

    def query(self) -> bool:
        """True once the operation completed (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling host thread until the operation completed."""


class DoneHandle:
    """An operation that completed when it was issued."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneHandle()


class EventHandle:
    """Completion signalled by a background thread (random-delay transport)."""

    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise RuntimeError("a random-delay transport copy failed") from self.error


class PooledEvent:
    """A CUDA event of an :class:`EventPool`; ``generation`` grows each time the pool hands it out again."""

    __slots__ = ("event", "generation")

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event
        self.generation = 0


class CudaHandle:
    """Completion of work on a CUDA stream, marked by an event recorded after it.

    A pooled event is recorded again only after it completed: a handle from an earlier generation reports
    done (its work finished before the reuse) and is never waited on. A wait racing the reuse (another thread
    re-records the event between the check and ``wait_event``) covers work enqueued before the wait: a longer
    wait at worst, never a missing order or a cycle.
    """

    __slots__ = ("pooled", "generation")

    def __init__(self, event: torch.cuda.Event | PooledEvent, generation: int | None = None) -> None:
        self.pooled = event if isinstance(event, PooledEvent) else PooledEvent(event)
        self.generation = self.pooled.generation if generation is None else generation

    @property
    def event(self) -> torch.cuda.Event:
        return self.pooled.event

    @property
    def current(self) -> bool:
        """The event still marks this handle's work (not recycled since)."""
        return self.pooled.generation == self.generation

    def query(self) -> bool:
        return not self.current or self.pooled.event.query()

    def synchronize(self) -> None:
        if self.current:
            self.pooled.event.synchronize()


class EventPool:
    """Events recorded on one stream, reused once they completed instead of created per copy.

    Created with ``blocking=True``: a host wait on them sleeps instead of spinning a core. Events recorded on
    one stream complete in record order, so the oldest live ones are the first to check for reuse.
    """

    def __init__(self) -> None:
        self._free: list[PooledEvent] = []
        self._live: deque[PooledEvent] = deque()
        self._lock = threading.Lock()  # the copy worker and the compute thread may each own a pool; cheap insurance
        self.created = 0

    def record(self, stream: torch.cuda.Stream) -> CudaHandle:
        with self._lock:
            while self._live and self._live[0].event.query():
                done = self._live.popleft()
                done.generation += 1  # earlier handles now read as done without touching the event
                self._free.append(done)
            if self._free:
                pooled = self._free.pop()
            else:
                pooled = PooledEvent(torch.cuda.Event(blocking=True))
                self.created += 1
            pooled.event.record(stream)
            self._live.append(pooled)
            return CudaHandle(pooled)


class Transport(Protocol):
    """Asynchronous host -> device copies plus the two orderings the scheduler needs."""

    name: str
    asynchronous: bool  # copies may complete after copy() returns (the copy engine then runs a worker thread)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        """Enqueue ``dst.copy_(src)`` to start once every handle of ``after`` completed."""

    def compute_fence(self) -> Handle:
        """A handle that completes when the compute issued so far is done (reads of slots included)."""

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        """Make compute issued from now on wait for ``handles``; returns host seconds spent blocked."""

    def synchronize(self) -> None:
        """Block until every copy issued so far completed."""

    def close(self) -> None:
        """Release threads or streams."""


@runtime_checkable
class BatchCopies(Protocol):
    """A transport that also takes several copies in one call (see the module docstring); the copy engine batches
    chunks only for those."""

    def copy_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[Handle] = ()) -> Handle:
        """Enqueue ``dst.copy_(src)`` of every pair, each starting once ``after`` completed; one handle
        completing when all did."""
        ...


class SyncTransport:
    """Copies happen inside :meth:`copy`; nothing is ever in flight."""

    name = "sync"
    asynchronous = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        return self.copy_batch([(dst, src)], after)

    def copy_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[Handle] = ()) -> Handle:
        for h in after:
            h.synchronize()
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def compute_fence(self) -> Handle:
        return DONE  # compute on the host thread is synchronous on the CPU

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        return 0.0

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


class RandomDelayTransport:
    """Test transport: each copy is performed by one of ``workers`` threads after a random delay.

    Jobs are taken in submission order but sleep for different times on different threads, so they
    complete out of order. A job only waits for handles of jobs submitted before it, so the earliest
    unfinished job can always progress (no deadlock with any number of workers).
    """

    name = "random-delay"
    asynchronous = True

    def __init__(self, max_delay_s: float = 0.002, seed: int = 0, workers: int = 3) -> None:
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[EventHandle] = []
        self._threads = [
            threading.Thread(target=self._run, name=f"moeflow-random-delay-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, after, handle = job
            try:
                for h in after:
                    h.synchronize()
                with self._rng_lock:
                    delay = self._rng.uniform(0.0, self.max_delay_s)
                time.sleep(delay)
                for dst, src in pairs:
                    dst.copy_(src)
            except BaseException as exc:  # reported to whoever waits on the handle
                handle.error = exc
            handle.event.set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        return self.copy_batch([(dst, src)], after)

    def copy_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[Handle] = ()) -> Handle:
        """One job: every copy of the batch after one random delay, completing on one handle."""
        handle = EventHandle()
        self._pending = [h for h in self._pending if not h.query()]
        self._pending.append(handle)
        self._jobs.put((list(pairs), tuple(after), handle))
        return handle

    def compute_fence(self) -> Handle:
        return DONE  # CPU compute has finished reading when the host call returns

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        t0 = time.perf_counter()
        for h in handles:
            h.synchronize()
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        for h in list(self._pending):
            h.synchronize()
        self._pending.clear()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


class CudaTransport:
    """Copies on a dedicated side stream; compute waits on per-copy events (device-side waits only).

    ``dst`` is a slice of the device slot pool, ``src`` a slice of the (ideally pinned) host store. The
    pool lives for the whole run, so no ``record_stream`` is needed for the caching allocator.
    Stall time: with ``time_stalls`` a pair of timing events brackets every device-side wait;
    :meth:`collect_stall_s` adds up the pairs that completed (no synchronize).
    """

    name = "cuda"
    asynchronous = True

    def __init__(self, device: torch.device, time_stalls: bool = True) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        # the stream the model computes on, bound now: fences recorded on another stream would order nothing
        self.compute_stream = torch.cuda.current_stream(self.device)
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._compute_handle = self.compute_stream.cuda_stream
        self.time_stalls = time_stalls
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.copy_events = EventPool()  # recorded by the copy worker on the side stream
        self.fence_events = EventPool()  # recorded by the compute thread on the compute stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        return self.copy_batch([(dst, src)], after)

    def copy_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[Handle] = ()) -> Handle:
        """Every copy on the side stream after the fences of ``after``, then one pooled event."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for h in after:
                if isinstance(h, CudaHandle) and h.current:  # a recycled event's work is done: nothing to wait for
                    self.stream.wait_event(h.event)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return self.copy_events.record(self.stream)

    def _check_stream(self) -> torch.cuda.Stream:
        """The compute stream, after checking that it is the current one: by its raw handle, the query Triton's
        launcher makes, since a ``torch.cuda.current_stream`` object costs ~18 us on the H100's host and a decode
        layer records two fences or more."""
        if current_stream_handle(self._index) == self._compute_handle:
            return self.compute_stream
        stream = torch.cuda.current_stream(self.device)
        if stream != self.compute_stream:
            raise RuntimeError(f"moeflow CudaTransport: the model computes on {stream}, but the transport was built "
                               f"for {self.compute_stream}; build the model under the stream it runs on")
        return stream

    def compute_fence(self) -> Handle:
        return self.fence_events.record(self._check_stream())

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        stream = self._check_stream()
        # tasks batched together share one handle: wait on each event once
        pending = list({id(h): h for h in handles if isinstance(h, CudaHandle) and not h.query()}.values())
        if not pending:
            return 0.0
        start = torch.cuda.Event(enable_timing=True) if self.time_stalls else None
        if start is not None:
            start.record(stream)
        for h in pending:
            stream.wait_event(h.event)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._stall_events.append((start, end))
        return 0.0

    def collect_stall_s(self) -> float:
        """Device-side stall seconds of the timed waits that have completed since the last call."""
        total, keep = 0.0, []
        for start, end in self._stall_events:
            if end.query():
                total += start.elapsed_time(end) / 1e3
            else:
                keep.append((start, end))
        self._stall_events = keep
        return total

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self._stall_events.clear()


def make_transport(name: str, device: torch.device, *, seed: int = 0, random_delay_ms: float = 2.0) -> Transport:
    """``"auto"``: CUDA streams on a CUDA device, synchronous otherwise; or ``"sync"`` / ``"random-delay"``."""
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "sync"
    if name == "cuda":
        return CudaTransport(device)
    if name == "sync":
        return SyncTransport()
    if name == "random-delay":
        return RandomDelayTransport(max_delay_s=random_delay_ms / 1e3, seed=seed)
    raise ValueError(f"unknown transport {name!r}: expected 'auto', 'sync', 'random-delay' or 'cuda'")
