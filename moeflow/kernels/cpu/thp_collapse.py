"""The weight forms a load wrote on 4 KB pages, moved onto huge pages after the model is ready (``MADV_COLLAPSE``).

Why (issue 37's cold start, session 18): first touching an advised 2 MB extent faults in a fresh huge page, and on a
VM whose balloon reports free memory to the host (``virtio_balloon`` free page reporting, ``page_reporting_order``
9: every free 2 MB block is handed back), a fresh huge page is one the host must back again: 0.3-0.9 GB/s of
first touch on this machine against 1.0-2.7 GB/s for 4 KB pages (``benchmarks/results/cold_start/s18-probe.md``),
which made the load of the 2-layer Mixtral-8x7B Q4_0 slice 0.5-1.5 s slower. So :mod:`hugepages` writes a load's
forms on plain 4 KB pages (inside :func:`~moeflow.kernels.cpu.hugepages.deferred`), and this module's one daemon
thread then advises each of those mappings ``MADV_HUGEPAGE`` and collapses its written extents 2 MB at a time
(``madvise(MADV_COLLAPSE)``, Linux 6.1+: the kernel copies the 512 small pages into one huge page and swaps the page
table entry under its locks; the bytes do not change, so a decode step reading them meanwhile reads the same
numbers, on small pages until its extent is swapped). The thread runs at nice :data:`NICE` and only while the rest of
the process is idle (:func:`_others_busy`): a collapse holds its core inside the kernel for ~4 ms per extent on this
VM, and a decode step whose OpenMP team has one thread per core then waits at every barrier for the thread that lost
its core (measured: 6.8 tok/s instead of 44 during the collapse on the 2-core machine). So a generation that starts
right after the load runs on small pages (the speed of ``MOEFLOW_HUGEPAGES=0``) and the collapse goes on when it
ends (a server's idle time, a script's next pause); a process that never idles keeps its small pages.

Where the kernel has no ``MADV_COLLAPSE`` (``EINVAL``), the mappings keep their ``MADV_HUGEPAGE`` advice, which
``khugepaged`` acts on in its own time; an extent the kernel cannot collapse now (``EAGAIN`` / ``ENOMEM``: no free
huge page) stays on small pages. A mapping whose tensors are all gone before its turn is skipped (weak
references), and one being collapsed is kept mapped until its last extent is done.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux >= 6.1 (Python's mmap module names it only from 3.13 on)
NICE = 10  # the collapsing thread's nice value: about a tenth of a busy core's time, all of an idle one
IDLE_WINDOW_S = 0.02  # how long the thread watches the process's CPU time before each batch of extents
IDLE_SHARE = 0.25  # the rest of the process counts as idle below this share of one core over the window
BATCH_S = 0.02  # how long one batch of extents may run before the next check (a generation that starts meanwhile
# waits at most about this long plus one extent)


@dataclass
class Deferred:
    """A mapping written on small pages: ``mapping`` (a weak reference to its ``mmap.mmap``), ``address`` (its 2 MB
    aligned start) and ``size`` (bytes from there, a multiple of 2 MB); ``used`` (bytes from ``address`` written so
    far: the extents to collapse) is advanced by the allocator."""
    mapping: weakref.ref
    address: int
    size: int
    used: int = 0


@dataclass
class Stats:
    """What the collapsing thread did in this process: extents ``collapsed`` and ``failed`` (left on small pages;
    ``errors``: their errno names), ``seconds`` spent (wall, the waits for an idle process included) and
    ``cpu_seconds`` (the thread's CPU time), ``unsupported`` (the kernel has no MADV_COLLAPSE: advice only) and
    ``idle_waits``."""
    collapsed: int = 0
    failed: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    unsupported: bool = False
    errors: dict[str, int] = field(default_factory=dict)
    idle_waits: int = 0  # windows of IDLE_WINDOW_S the thread waited for the process to idle


@functools.cache
def _libc_madvise() -> ctypes._CFuncPtr:
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # (only used where hugepages defers: Linux)
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _others_busy(window_s: float = IDLE_WINDOW_S) -> bool:
    """Whether the process's other threads used more than :data:`IDLE_SHARE` of a core over the next ``window_s``
    seconds (this thread sleeps meanwhile)."""
    p0, t0 = time.process_time(), time.thread_time()
    time.sleep(window_s)
    return (time.process_time() - p0) - (time.thread_time() - t0) > IDLE_SHARE * window_s


def _madvise(address: int, size: int, advice: int) -> int:
    """0, or the errno of ``madvise(address, size, advice)`` (ctypes releases the GIL for the call)."""
    return 0 if _libc_madvise()(address, size, advice) == 0 else ctypes.get_errno()


class Collapser:
    """One daemon thread collapsing submitted mappings in order (thread safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Deferred] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.stats = Stats()

    def submit(self, mappings: list[Deferred]) -> None:
        """Collapse ``mappings`` (their ``used`` bytes) in the background, after any submitted before."""
        if not mappings:
            return
        with self._cond:
            self._queue.extend(mappings)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="moeflow-thp-collapse")
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted mapping is collapsed (or skipped); False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):  # (not Linux, or not allowed: full priority then)
            pass
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                item, self._busy = self._queue.popleft(), True
            try:
                self._collapse(item)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _collapse(self, item: Deferred) -> None:
        mapping = item.mapping()  # (held until done: the mapping stays mapped meanwhile)
        if mapping is None:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        if _madvise(item.address, item.size, MADV_HUGEPAGE) == 0 and not self.stats.unsupported:
            end = min(item.size, -(-item.used // HUGE_PAGE) * HUGE_PAGE)
            batch_end = 0.0
            for at in range(0, end, HUGE_PAGE):
                if time.perf_counter() >= batch_end:  # (a new batch: only once the rest of the process idles)
                    while _others_busy():
                        self.stats.idle_waits += 1
                    batch_end = time.perf_counter() + BATCH_S
                err = _madvise(item.address + at, HUGE_PAGE, MADV_COLLAPSE)
                if err == errno.EINVAL:  # (no MADV_COLLAPSE before Linux 6.1: the advice stays, for khugepaged)
                    self.stats.unsupported = True
                    break
                if err:
                    self.stats.failed += 1
                    name = errno.errorcode.get(err, str(err))
                    self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
                else:
                    self.stats.collapsed += 1
        self.stats.seconds += time.perf_counter() - t0
        self.stats.cpu_seconds += time.thread_time() - c0
        del mapping


COLLAPSER = Collapser()


def _after_fork_in_child() -> None:
    """A forked child has no collapsing thread (and may have forked while its lock was held): it starts afresh; the
    parent's queued mappings are left to the parent's thread (the child's copies stay on small pages)."""
    COLLAPSER.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
