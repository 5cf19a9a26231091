"""Where the dual-batch pipeline's side work (path prediction, token scheduling) runs: a :class:`Lane`.

* :class:`ThreadLane`: one worker thread (jobs in submission order), on a GPU with its own CUDA stream, so a
  job runs beside the main thread's forward pass (ExpertFlow §4.2). torch releases the GIL in its kernels.
* :class:`InlineLane`: the job runs at once on the calling thread, on the critical path: the same work in the
  same order without the overlap (the "without the pipeline" baseline of the benchmark).
* :class:`VirtualLane`: jobs cost given virtual seconds on a virtual clock (tests, the virtual-clock benchmark).

Both time what they do: ``busy_s`` (seconds of side work) and ``exposed_s`` (seconds the main thread spent
waiting for it: all of ``busy_s`` inline, what the overlap did not hide on the thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class Lane:
    """submit(fn, *args) -> Future; wait(future) -> result (time spent waiting counts as exposed)."""

    overlaps = False

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.busy_s = 0.0
        self.exposed_s = 0.0
        self.jobs = 0

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = self.clock()
        try:
            return fn(*args)
        finally:
            self.busy_s += self.clock() - t0
            self.jobs += 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        raise NotImplementedError

    def wait(self, future: Future) -> Any:
        if future.done():
            return future.result()
        t0 = self.clock()
        try:
            return future.result()
        finally:
            self.exposed_s += self.clock() - t0

    def close(self) -> None:
        return None


class InlineLane(Lane):
    """Runs each job when it is submitted, on the caller's thread (no overlap)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        t0 = self.clock()
        try:
            future.set_result(self._timed(fn, *args))
        except BaseException as e:  # handed to whoever waits, as a thread's failure would be
            future.set_exception(e)
        self.exposed_s += self.clock() - t0
        return future


class ThreadLane(Lane):
    """One worker thread; on ``device`` of type cuda its jobs run on a side stream."""

    overlaps = True

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(clock)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-dual-batch")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.stream is None:
            return self._timed(fn, *args)
        with torch.cuda.stream(self.stream):
            out = self._timed(fn, *args)
            self.stream.synchronize()  # results are host tensors or host lists; nothing else waits on the stream
            return out

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.pool.submit(self._run, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _VirtualFuture(Future):
    """A job's result, done once the virtual clock reaches ``ready``; waiting for it moves the clock there."""

    def __init__(self, clock: Any, ready: float) -> None:
        super().__init__()
        self.clock, self.ready = clock, ready

    def done(self) -> bool:
        return self.clock() >= self.ready

    def result(self, timeout: float | None = None) -> Any:
        self.clock.advance_to(self.ready)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.clock.advance_to(self.ready)
        return super().exception(timeout)


class VirtualLane(Lane):
    """Side work in virtual time (tests, benchmarks on ``moeflow.sim``'s SimClock or any clock with
    ``advance_to``): a job runs at once, but counts as done only at max(its submission, the previous job's end)
    + ``cost(fn)`` seconds. ``overlaps=False``: the host is blocked for that time at submission instead."""

    def __init__(self, clock: Any, cost: Callable[[Callable[..., Any]], float], overlaps: bool = True) -> None:
        super().__init__(clock)
        self.cost, self.overlaps = cost, overlaps
        self.free = 0.0  # when the lane finishes what it holds

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        seconds = self.cost(fn)
        start = max(self.clock(), self.free)
        self.free = start + seconds
        self.busy_s += seconds
        self.jobs += 1
        future = _VirtualFuture(self.clock, self.free)
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        if not self.overlaps:
            self.exposed_s += self.free - self.clock()
            self.clock.advance_to(self.free)
        return future
