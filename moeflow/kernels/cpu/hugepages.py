"""moeflow's CPU weight forms on transparent huge pages (issue 42).

Why: the CPU kernels stream every weight of a decode step once (memory-bound), and on 4 KB pages the hardware
prefetchers stop at each page boundary and every 4 KB costs a TLB entry. On a kernel whose transparent huge pages
are ``madvise`` only (the usual distribution default), memory is placed on 2 MB pages only where the process asks
(``madvise(MADV_HUGEPAGE)``). torch's ``THP_MEM_ALLOC_ENABLE=1`` asks for every allocation of 2 MB and more and
measured +6 % decode tok/s at one thread and +19 % at two on the AWQ peer model (docs/cpu.md, "huge pages"); but
it is a process-wide switch that c10 reads once, at its first large allocation, so a library cannot rely on it
and should not change the whole process. moeflow instead allocates **its own CPU weight forms** (the q4 expert
matrices, the int8 / int4 attention and lm_head matrices, the CPU host store) with :func:`empty` / :func:`copy` /
:func:`cat` here: the same bytes in another allocation, so the numbers do not change.

How: anonymous private mappings (``mmap.mmap(-1, n, MAP_PRIVATE | MAP_ANONYMOUS)``: a shared anonymous mapping is
shmem, which THP's ``shmem_enabled`` governs, usually ``never``) advised ``MADV_HUGEPAGE``, with the tensors placed
from a 2 MB boundary of the mapping and wrapped by ``torch.frombuffer`` (each tensor's storage keeps its mapping
alive; a mapping is unmapped when its last tensor goes). A tensor of :data:`CHUNK` / 2 or more gets a mapping of
its own, rounded up to 2 MB; smaller ones (an expert's down matrix of a small model: 1.8 MB on the peer model,
a third of its expert bytes) are packed one after the other ([:data:`ALIGN`]-byte aligned) into shared
:data:`CHUNK`-byte mappings (a bump arena; a chunk is freed when every tensor in it is), so they share huge pages
rather than each rounding up to one. The arena never reuses a freed tensor's bytes, so a form made only to be
copied and dropped (q, k and v before the CPU step fuses them, a conversion's scratch) is made inside
:func:`plain`, in torch's memory, lest its bytes stay resident in a chunk beside kept forms.

Where it falls back to ``torch.empty`` (plain 4 KB-page memory, the same results): not Linux or a Python without
``mmap.MADV_HUGEPAGE``; THP ``never`` on this kernel (nothing would be gained); tensors under :data:`MIN_BYTES`
(scales of a small matrix: a page or a few, not worth holding a chunk for); ``madvise`` refused (a kernel built
without THP: then off for the process); ``MOEFLOW_HUGEPAGES=0`` in the environment (read at every allocation: the
A/B switch). Cost: first touching an advised 2 MB extent faults in (and zeroes) a whole huge page, and on this VM
a fresh huge page is one the host must back again (its balloon's free page reporting hands every free 2 MB block
back): 0.3-0.9 GB/s against 1.0-2.7 for 4 KB pages (:mod:`~moeflow.kernels.cpu.thp_collapse`). So a load
(``from_pretrained``, inside :func:`deferred`) writes the forms on 4 KB pages, at the old load's speed, and a
background thread collapses them onto huge pages once the model is ready (``MADV_COLLAPSE``, Linux 6.1+; else
the advice, for ``khugepaged``); :func:`wait_collapsed` waits for it. ``MOEFLOW_HUGEPAGES=fault`` faults huge
pages in at load instead (session 17's way; A/B runs). The form cache's mapped files (``cpu_form_cache``) and
mapped GGUF views are file pages, which anonymous huge pages do not cover.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from moeflow.kernels.cpu.thp_collapse import COLLAPSER, Deferred

HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KB base pages) PMD size
CHUNK = 32 << 20  # the arena's mappings for tensors under CHUNK / 2
MIN_BYTES = 64 << 10  # smaller tensors stay on torch's allocator
ALIGN = 64  # each arena tensor starts on a cache line
ENV = "MOEFLOW_HUGEPAGES"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

FAULT = "fault"  # MOEFLOW_HUGEPAGES=fault: huge pages faulted in at load too (session 17's way; for A/B runs)

_refused = False  # madvise(MADV_HUGEPAGE) failed once: off for this process
_defer_lock = threading.Lock()
_defer_depth = 0  # deferred() contexts open in this process
_pending: list[Deferred] = []  # mappings made while deferring, for the collapse when the last one closes
_local = threading.local()  # .plain: depth of plain() on this thread


@functools.cache
def thp_mode() -> str | None:
    """This kernel's THP mode (``always``, ``madvise``, ``never``), or None where it has none (not Linux, no THP);
    read once per process (an administrator's setting), not at each of a load's thousands of allocations."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def enabled() -> bool:
    """Whether :func:`empty` places large tensors on huge-page-advised mappings here (module doc's fallbacks), on
    this thread (not inside :func:`plain`)."""
    return os.environ.get(ENV, "1") != "0" and not getattr(_local, "plain", 0) and sys.platform.startswith("linux") \
        and hasattr(mmap, "MADV_HUGEPAGE") and not _refused and thp_mode() in ("always", "madvise")


@contextmanager
def plain() -> Iterator[None]:
    """Within it, on this thread, :func:`empty` is ``torch.empty``: for forms about to be copied and dropped (q, k
    and v before the CPU step fuses them, a conversion's temporaries). An arena chunk is unmapped only when all its
    tensors are gone, so a short-lived tensor placed among long-lived ones would keep its bytes resident."""
    _local.plain = getattr(_local, "plain", 0) + 1
    try:
        yield
    finally:
        _local.plain -= 1


def deferring() -> bool:
    """Whether new mappings are left on small pages for :func:`deferred`'s collapse (a load is running in this
    process, and ``MOEFLOW_HUGEPAGES`` is not ``fault``)."""
    return _defer_depth > 0 and os.environ.get(ENV, "1") != FAULT


@contextmanager
def deferred() -> Iterator[None]:
    """Within it (process wide: a load's loader threads allocate too), the mappings :func:`empty` makes are not
    advised, so a load writes its forms on 4 KB pages, which are faster to fault in fresh than huge pages on this
    VM (:mod:`~moeflow.kernels.cpu.thp_collapse`); when the last one open is left, those mappings' written extents
    are collapsed onto huge pages by a background thread (:data:`~moeflow.kernels.cpu.thp_collapse.COLLAPSER`;
    :func:`wait_collapsed` waits for it). Mappings made outside are advised at once (faulted in as huge pages)."""
    global _defer_depth
    with _defer_lock:
        _defer_depth += 1
    try:
        yield
    finally:
        with _defer_lock:
            _defer_depth -= 1
            last = _defer_depth == 0
            batch = list(_pending) if last else []
            if last:
                _pending.clear()
        if last:  # (outside _defer_lock: the arena's lock is taken before it in take())
            _ARENA.retire()  # (its chunk, if deferred, takes no more tensors: later ones get advised memory)
        COLLAPSER.submit(batch)


def wait_collapsed(timeout: float | None = None) -> bool:
    """Wait until the background collapse of every finished load's forms is done; False on ``timeout`` (seconds).
    For benchmarks of steady decode and tests: the tokens are the same before, during and after."""
    return COLLAPSER.wait(timeout)


def _advised(nbytes: int) -> tuple[memoryview, Deferred | None] | None:
    """A writable view of ``nbytes`` (a multiple of :data:`HUGE_PAGE`) starting on a 2 MB boundary of a fresh
    anonymous private mapping advised ``MADV_HUGEPAGE`` (None where the kernel refuses the advice), or, while
    :func:`deferring`, not advised and registered for the collapse (its record returned beside the view)."""
    global _refused
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    defer = deferring()
    try:
        if not defer:
            mm.madvise(mmap.MADV_HUGEPAGE)  # the whole mapping: one VMA (the unused head and tail are never touched)
        elif thp_mode() == "always":
            mm.madvise(mmap.MADV_NOHUGEPAGE)  # (small pages until the collapse, which advises MADV_HUGEPAGE first)
    except OSError:
        _refused = True
        mm.close()
        return None
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # (releases its export of the mapping)
    start = -address % HUGE_PAGE
    record = None
    if defer:
        record = Deferred(weakref.ref(mm), address + start, nbytes)
        with _defer_lock:
            _pending.append(record)
    return memoryview(mm)[start:start + nbytes], record


class _Arena:
    """Bump allocation of tensors under :data:`CHUNK` / 2 from shared advised chunks (thread safe: loader threads
    convert experts concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: memoryview | None = None
        self._record: Deferred | None = None  # the chunk's, while it awaits a deferred collapse
        self._used = 0

    def take(self, nbytes: int) -> memoryview | None:
        if nbytes >= CHUNK // 2:
            got = _advised(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
            if got is None:
                return None
            if got[1] is not None:
                got[1].used = nbytes
            return got[0][:nbytes]
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > len(self._chunk) or (self._record is not None) != deferring():
                got = _advised(CHUNK)
                if got is None:
                    return None
                (self._chunk, self._record), start = got, 0  # the old chunk lives on in its tensors
            self._used = start + nbytes
            if self._record is not None:
                self._record.used = self._used
            return self._chunk[start:start + nbytes]

    def retire(self) -> None:
        """A deferred chunk takes no more tensors (its collapse covers what it holds now)."""
        with self._lock:
            if self._record is not None:
                self._chunk, self._record = None, None


_ARENA = _Arena()


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` and ``dtype`` (contiguous), on a huge-page-advised mapping where
    :func:`enabled` and it is :data:`MIN_BYTES` or more, else ``torch.empty`` (module doc)."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    view = _ARENA.take(nbytes)
    if view is None:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(view, dtype=dtype, count=numel).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values (a CPU tensor [...]) in a contiguous tensor from :func:`empty`; ``t`` itself where that would
    be plain memory anyway (small, or off) and ``t`` is contiguous."""
    if t.numel() * t.element_size() < MIN_BYTES or not enabled():
        return t.contiguous()
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` (tensors of one dtype) written into a tensor from :func:`empty` (off the CPU:
    ``torch.cat``)."""
    if tensors[0].device.type != "cpu":
        return torch.cat(list(tensors), dim)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(list(tensors), dim, out=empty(shape, tensors[0].dtype))


def mapping_of(t: torch.Tensor) -> dict[str, object] | None:
    """The ``/proc/self/smaps`` entry of the mapping holding ``t``'s first byte: ``{"range": (lo, hi), "flags":
    set of VmFlags (``hg``: advised MADV_HUGEPAGE), "AnonHugePages": kB, "pathname": str}``; None where there is
    no smaps (not Linux) or no mapping holds it. For tests and diagnostics."""
    address = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    found: dict[str, object] | None = None
    for line in lines:
        head = line.split(None, 1)[0] if line.strip() else ""
        if "-" in head and ":" not in head:  # a mapping's first line: lo-hi perms offset dev inode [pathname]
            if found is not None:
                return found
            lo, hi = (int(x, 16) for x in head.split("-"))
            parts = line.split(None, 5)
            found = {"range": (lo, hi), "flags": set(), "AnonHugePages": 0,
                     "pathname": parts[5] if len(parts) > 5 else ""} if lo <= address < hi else None
        elif found is not None and head == "VmFlags:":
            found["flags"] = set(line.split()[1:])
        elif found is not None and head == "AnonHugePages:":
            found["AnonHugePages"] = int(line.split()[1])
    return found
