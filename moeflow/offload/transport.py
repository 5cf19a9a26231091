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
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch


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


class CudaHandle:
    """Completion of work on a CUDA stream, marked by an event recorded after it."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


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


class SyncTransport:
    """Copies happen inside :meth:`copy`; nothing is ever in flight."""

    name = "sync"
    asynchronous = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        for h in after:
            h.synchronize()
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
            dst, src, after, handle = job
            try:
                for h in after:
                    h.synchronize()
                with self._rng_lock:
                    delay = self._rng.uniform(0.0, self.max_delay_s)
                time.sleep(delay)
                dst.copy_(src)
            except BaseException as exc:  # reported to whoever waits on the handle
                handle.error = exc
            handle.event.set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        handle = EventHandle()
        self._pending = [h for h in self._pending if not h.query()]
        self._pending.append(handle)
        self._jobs.put((dst, src, tuple(after), handle))
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
        self.time_stalls = time_stalls
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._last: torch.cuda.Event | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Handle] = ()) -> Handle:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for h in after:
                if isinstance(h, CudaHandle):
                    self.stream.wait_event(h.event)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # a host wait sleeps instead of spinning a core
            event.record(self.stream)
        self._last = event
        return CudaHandle(event)

    def _check_stream(self) -> torch.cuda.Stream:
        stream = torch.cuda.current_stream(self.device)
        if stream != self.compute_stream:
            raise RuntimeError(f"moeflow CudaTransport: the model computes on {stream}, but the transport was built "
                               f"for {self.compute_stream}; build the model under the stream it runs on")
        return stream

    def compute_fence(self) -> Handle:
        event = torch.cuda.Event(blocking=True)
        event.record(self._check_stream())
        return CudaHandle(event)

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        stream = self._check_stream()
        pending = [h for h in handles if isinstance(h, CudaHandle) and not h.query()]
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
