"""Wiring the disk tier (GPU slots <- host store <- disk) into the offloading backend.

* :func:`host_rows`: how many experts ``OffloadConfig.host_memory_gb`` holds in host memory once the non-expert
  weights kept on the host and the readers' staging buffers are counted; a clear error below the minimum.
* :func:`host_eviction`: the host tier's own eviction policy, of the same kind as the device cache's.
* :class:`StagedCopyEngine`: the copy engine, with every submitted copy first made to wait for its expert to be
  in host memory (``acquire``) and then holding the host row until its chunks landed (``hold``).
* :func:`make_disk_store`: the :class:`~moeflow.offload.disk_store.DiskHostStore`, warm-filled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moeflow.config import OffloadConfig, load_workers
from moeflow.errors import SchedulingError
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.offload.contracts import LoadQueue
from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.disk_store import DiskHostStore
from moeflow.offload.eviction import LFU, LRU, EvictionPolicy, PriorityEviction, Static
from moeflow.offload.host_store import HostStore
from moeflow.offload.stats import PhaseStats
from moeflow.offload.transport import Handle, Transport
from moeflow.offload.units import format_bytes as _size

GiB = 2**30


def host_rows(config: OffloadConfig, *, fmt: ExpertFormat, total: int, min_rows: int, host_reserved_bytes: int,
              staging_bytes: int, host_memory_bytes: float) -> int | None:
    """Expert rows the host budget holds; None when every expert fits (no disk tier needed).

    host_reserved_bytes: what else lives in host memory (non-expert weights on a CPU device); staging_bytes:
    the reader threads' buffers. Raises SchedulingError naming every size when fewer than ``min_rows`` fit.
    """
    rows = int((host_memory_bytes - host_reserved_bytes - staging_bytes) // fmt.nbytes)
    if rows >= total:
        return None
    if rows < min_rows:
        raise SchedulingError(
            f"host_memory_gb={config.host_memory_gb}: {_size(host_memory_bytes)} of host memory leaves room for "
            f"{max(rows, 0)} experts after {_size(host_reserved_bytes)} of non-expert weights and "
            f"{_size(staging_bytes)} of disk staging buffers; the minimum is {min_rows} experts of {_size(fmt.nbytes)} "
            f"(the larger of top-k and prefill_ring_slots), i.e. host_memory_gb >= "
            f"{(host_reserved_bytes + staging_bytes + min_rows * fmt.nbytes) / GiB:.3g}")
    return rows


def host_eviction(device_policy: EvictionPolicy, rows: int, ring: int) -> EvictionPolicy:
    """A fresh policy of the device cache's kind for the host rows (predictor scores shared, counts not)."""
    if isinstance(device_policy, PriorityEviction):
        return PriorityEviction(host_eviction(device_policy.base, rows, ring), device_policy.score)
    if isinstance(device_policy, Static):
        return Static(rows - ring)
    if isinstance(device_policy, LFU):
        return LFU()
    return LRU()


class StagedCopyEngine:
    """A :class:`~moeflow.offload.contracts.LoadQueue` whose ``submit`` first has the expert read into host
    memory; every other call goes to ``inner`` (the platform's copy engine)."""

    def __init__(self, inner: LoadQueue, host: DiskHostStore) -> None:
        self.inner = inner
        self.host = host
        self.threaded = inner.threaded
        host.bind_engine(inner)

    def submit(self, layer: int, expert: int, slot: int, *, high: bool, after: Sequence[Handle] = (),
               stats: PhaseStats | None = None, priority: float = 0.0) -> LoadTask:
        self.host.acquire(layer, expert)
        try:
            task = self.inner.submit(layer, expert, slot, high=high, after=after, stats=stats, priority=priority)
        except BaseException:
            self.host.release(layer, expert)
            raise
        self.host.hold(task)
        return task

    def set_low_chunks(self, chunks: Sequence[tuple[int, int]]) -> None:
        self.inner.set_low_chunks(chunks)

    def promote(self, task: LoadTask) -> None:
        self.inner.promote(task)

    def cancel(self, task: LoadTask) -> list[Handle]:
        return self.inner.cancel(task)

    def preempt(self, layer: int, needed: set[int]) -> tuple[list[LoadTask], list[LoadTask]]:
        return self.inner.preempt(layer, needed)

    def pending(self) -> list[LoadTask]:
        return self.inner.pending()

    def high_backlog(self) -> list[tuple[LoadTask, int]]:
        return self.inner.high_backlog()

    def wait_issued(self, task: LoadTask) -> None:
        self.inner.wait_issued(task)

    def pump(self, max_chunks: int | None = None) -> int:
        return self.inner.pump(max_chunks)

    def close(self) -> None:
        self.inner.close()


def staged_engine_factory(make_engine: Callable[..., LoadQueue], host: DiskHostStore) -> Callable[..., LoadQueue]:
    """Platform.copy_engine for the disk tier: ``make_engine``'s engine behind :class:`StagedCopyEngine`."""

    def make(transport: Transport, host_store: HostStore, pool: ExpertPool, **kwargs: int) -> LoadQueue:
        return StagedCopyEngine(make_engine(transport, host_store, pool, **kwargs), host)

    return make


def make_disk_store(config: OffloadConfig, source, fmt: ExpertFormat, rows: int, eviction: EvictionPolicy, *,
                    device, warm: bool = True) -> DiskHostStore:
    """The disk-backed host store, warm-filled at load with the first ``rows`` experts in the order the device
    pool fills (expert 0 of every layer, then expert 1, ...)."""
    store = DiskHostStore(fmt, source, rows, eviction, pin=config.pin_memory, device=device,
                          readers=config.disk_readers)
    if warm:
        order = fill_order(source.num_layers, source.num_experts)
        try:
            store.warm_fill(order[:rows])
        except BaseException:
            store.close()
            raise
    return store


AUTO_MARGIN = 0.10  # "auto" leaves this share of the available memory to the rest of the machine
AUTO_MIN_MARGIN = 1 * GiB


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (else free physical pages): what the machine can give without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_bytes(config: OffloadConfig) -> float:
    """``host_memory_gb`` in bytes; "auto": the available memory minus max(10%, 1 GiB)."""
    if config.host_memory_gb == "auto":
        free = available_host_bytes()
        return free - max(free * AUTO_MARGIN, AUTO_MIN_MARGIN)
    return float(config.host_memory_gb) * GiB


def maybe_disk_store(config: OffloadConfig, *, expert_source, fmt: ExpertFormat, total: int, min_rows: int,
                     device_eviction: EvictionPolicy, host_reserved_bytes: int, device) -> DiskHostStore | None:
    """The disk-backed host store ``config.host_memory_gb`` asks for, or None when every expert fits."""
    if config.host_memory_gb is None and not config.background_load:
        return None
    if expert_source is None:
        raise ValueError("OffloadConfig.host_memory_gb / background_load need the checkpoint's expert index "
                         "(ExpertIndex), which from_pretrained builds; this backend was created without one")
    readers = max(1, config.disk_readers)
    if config.background_load:
        readers = max(readers, load_workers())
    rows = None
    if config.host_memory_gb is not None:
        rows = host_rows(config, fmt=fmt, total=total, min_rows=min_rows, host_reserved_bytes=host_reserved_bytes,
                         staging_bytes=readers * expert_source.staging_nbytes,
                         host_memory_bytes=host_memory_bytes(config))
    if rows is None and not config.background_load:
        return None
    rows = total if rows is None else rows
    eviction = host_eviction(device_eviction, rows, min_rows)
    if not config.background_load:
        return make_disk_store(config, expert_source, fmt, rows, eviction, device=device)
    store = DiskHostStore(fmt, expert_source, rows, eviction, pin=config.pin_memory, device=device, readers=readers)
    store.background_fill(fill_order(expert_source.num_layers, expert_source.num_experts)[:rows])
    return store


def fill_order(num_layers: int, num_experts: int) -> list[tuple[int, int]]:
    """The order experts are read into host memory at load: the order the device pool fills (expert 0 of every
    layer, then expert 1, ...), so the first slots' experts come first."""
    return [(i % num_layers, i // num_layers) for i in range(num_layers * num_experts)]
