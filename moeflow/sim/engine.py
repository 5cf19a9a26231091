"""Virtual time behind the real scheduler: a clock, a transport with a copy and a compute stream, and the
copy engine's worker thread replayed in virtual time.

These are the only simulated parts. ``OffloadedExperts``, ``ExpertCache``, the eviction policies, the
predictors and ``CopyEngine``'s queue (priorities, chunking, preemption, promotion) are the real ones.

Model of the device (what CUDA does with one compute and one copy stream):

* **copy stream**: in order. A chunk of ``b`` bytes issued at host time ``t`` starts at
  ``max(t, end of the previous chunk, end of every fence it waits on)`` and takes
  ``b * scale / bandwidth + latency`` (``scale``: profile expert bytes per simulated expert byte).
* **compute stream**: in order. Work enqueued at host time ``t`` starts at ``max(t, end of the previous
  work, end of the copies it was told to wait for)``; :meth:`SimTransport.wait_compute` is the
  device-side ``stream.wait_event``. The time the stream sits idle because of such a wait is the stall.
* **host**: the clock. It advances only when the host blocks: a handle's ``synchronize``, the copy
  engine's ``wait_issued``, and the simulator's own per-layer routing sync and scheduling overhead.
* **copy worker** (:class:`SimCopyEngine`): the real worker thread keeps at most ``max_inflight`` chunks in
  the stream and issues the next one when the oldest completes; here that happens whenever the clock
  passes a completion, so preemption and priorities act exactly when they would on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.offload.copy_engine import CopyEngine, LoadTask
from moeflow.offload.host_store import HostStore


@dataclass
class Interval:
    """One bar of a timeline lane."""

    lane: str  # "compute" or "copy"
    kind: str  # compute: attention / expert / head / wait; copy: needed / prefetch
    start: float
    end: float
    label: str = ""


class SimClock:
    """Host time in seconds. Callable, so it is a ``Platform.clock``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.engine: SimCopyEngine | None = None  # the copy worker runs while time passes

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Block the host until ``t``, letting the copy worker issue what it would meanwhile."""
        if t <= self.now:
            return
        if self.engine is not None:
            self.engine.run_until(t)
        self.now = t


class SimHandle:
    """Completion at a known virtual time."""

    __slots__ = ("clock", "end")

    def __init__(self, clock: SimClock, end: float) -> None:
        self.clock = clock
        self.end = end

    def query(self) -> bool:
        return self.end <= self.clock.now

    def synchronize(self) -> None:
        self.clock.advance_to(self.end)


class SimTransport:
    """A :class:`moeflow.offload.transport.Transport` whose copies and compute take virtual time.

    ``scale``: real bytes per simulated byte (the simulator keeps tiny expert regions in memory and
    charges each chunk its share of the profile's expert size). ``num_experts`` and ``region_bytes``
    turn a host-store slice back into (layer, expert) for the timeline labels.
    """

    name = "sim"
    asynchronous = False  # no thread: SimCopyEngine replays the worker in virtual time

    def __init__(self, clock: SimClock, *, bandwidth_bps: float, latency_s: float, scale: float,
                 region_bytes: int, num_experts: int) -> None:
        if not bandwidth_bps > 0:
            raise ValueError(f"host->device bandwidth must be > 0, got {bandwidth_bps} B/s")
        self.clock = clock
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self.scale = scale
        self.region_bytes = region_bytes
        self.num_experts = num_experts
        self.copy_free = 0.0  # when the copy stream finishes what it holds
        self.compute_free = 0.0  # when the compute stream finishes what it holds
        self.stall_s = 0.0  # compute-stream time spent waiting for copies
        self.copy_busy_s = 0.0
        self.compute_busy_s = 0.0
        self.record = False
        self.intervals: list[Interval] = []
        self.next_copy_kind = "needed"  # set by SimCopyEngine before each issue (needed = high priority)
        self.last: SimHandle | None = None
        self.disk = None  # a SimDiskTier: copies of experts not in host memory first wait for their disk read

    @property
    def link_bytes_per_s(self) -> float:
        """Host-store bytes per second (the prefetch gate's KnownLinkRate): the profile's rate over ``scale``."""
        return self.bandwidth_bps / self.scale

    def log(self, lane: str, kind: str, start: float, end: float, label: str) -> None:
        """Record a timeline bar (when recording): lanes compute, copy, disk, cpu."""
        if self.record and end > start:
            self.intervals.append(Interval(lane, kind, start, end, label))

    # ----------------------------------------------------------------- Transport protocol
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence = ()) -> SimHandle:
        start = max([self.clock.now, self.copy_free, *(getattr(h, "end", 0.0) for h in after)])
        region = src.storage_offset() // self.region_bytes
        layer, expert = divmod(region, self.num_experts)
        if self.disk is not None:
            ready, read_start = self.disk.ready_at((layer, expert), self.clock.now)
            if read_start is not None:
                self.log("disk", self.next_copy_kind, read_start, ready, f"L{layer} E{expert}")
            start = max(start, ready)
        end = start + src.numel() * self.scale / self.bandwidth_bps + self.latency_s
        self.copy_free = end
        self.copy_busy_s += end - start
        self.log("copy", self.next_copy_kind, start, end, f"L{layer} E{expert}")
        self.last = SimHandle(self.clock, end)
        return self.last

    def compute_fence(self) -> SimHandle:
        return SimHandle(self.clock, self.compute_free)

    def wait_compute(self, handles: Sequence) -> float:
        target = max((getattr(h, "end", 0.0) for h in handles), default=0.0)
        base = max(self.compute_free, self.clock.now)
        if target > base:
            self.stall_s += target - base
            self.log("compute", "wait", base, target, "wait for copy")
            self.compute_free = target
        return 0.0

    def synchronize(self) -> None:
        self.clock.advance_to(self.copy_free)

    def close(self) -> None:
        return None

    # ----------------------------------------------------------------- compute stream
    def compute(self, seconds: float, kind: str, label: str = "") -> float:
        """Enqueue ``seconds`` of compute at the current host time; returns when it ends."""
        start = max(self.compute_free, self.clock.now)
        self.compute_free = start + seconds
        self.compute_busy_s += seconds
        self.log("compute", kind, start, self.compute_free, label)
        return self.compute_free


class SimHostStore(HostStore):
    """A host store whose (tiny) regions count as loaded: the simulator never reads expert bytes."""

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int, *, pin: bool = False,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(fmt, num_layers, num_experts, pin=False, device="cpu")
        self.loaded.fill_(True)


class SimCopyEngine(CopyEngine):
    """The real :class:`CopyEngine` queue; its worker thread replayed in virtual time.

    The worker loop is: wait for work, wait until fewer than ``max_inflight`` chunks are in the stream
    (the oldest completes), issue the next chunk (the queue's choice: :meth:`CopyEngine.head`, issued by
    :meth:`CopyEngine.issue_next`).
    :meth:`pump` runs that loop at the current virtual time, :meth:`run_until` while the clock moves.
    """

    def __init__(self, transport: SimTransport, host: HostStore, pool: ExpertPool, *, chunks: int = 3,
                 max_inflight: int = 2, threaded: bool | None = None) -> None:
        super().__init__(transport, host, pool, chunks=chunks, max_inflight=max_inflight, threaded=False)
        self.sim = transport
        self.clock = transport.clock
        self.clock.engine = self
        self._window: deque[SimHandle] = deque()  # chunks in the stream, oldest first

    def _queued(self) -> bool:
        return self.head() is not None

    def pump(self, max_chunks: int | None = None) -> int:
        """Issue queued chunks while fewer than ``max_inflight`` are in the stream at the current time."""
        n = 0
        while max_chunks is None or n < max_chunks:
            while self._window and self._window[0].query():
                self._window.popleft()
            head: LoadTask | None = self.head()
            if len(self._window) >= self.max_inflight or head is None:
                break
            self.sim.next_copy_kind = "needed" if head.high else "prefetch"
            self._window.append(self.issue_next())
            n += 1
        return n

    def next_event(self) -> float | None:
        """When the worker can issue again: the oldest chunk's completion (None: nothing to issue)."""
        if not self._queued() or not self._window:
            return None
        return self._window[0].end

    def run_until(self, t: float) -> None:
        """The worker's activity while the host clock moves to ``t``."""
        self.pump()
        while (event := self.next_event()) is not None and event <= t:
            self.clock.now = max(self.clock.now, event)
            self.pump()

    def wait_issued(self, task: LoadTask) -> None:
        """The host blocks until every chunk of ``task`` is in the stream."""
        if task.cancelled:
            raise RuntimeError(f"waiting on cancelled load of expert {task.key}")
        self.pump()
        while not task.issued:
            event = self.next_event()
            if event is None:
                raise RuntimeError(f"load of expert {task.key} is not queued")
            self.clock.advance_to(event)
