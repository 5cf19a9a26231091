"""The disk tier in virtual time: which experts the host cache holds, and when a read from disk lands.

Model (docs/disk.md): the host cache holds ``capacity`` experts, least recently used out first. A copy to the
device of an expert not in it first reads the expert from disk: the disk serves one read at a time at
``disk_gbps`` (reads queue behind each other), and each read also waits ``disk_latency_us`` (overlapped
between queued reads, as with several reader threads). The copy starts when the read has landed, so a
prefetch's read overlaps compute exactly as its copy does. Simplification: an expert being copied is never
evicted from the host cache in the model (the real store pins it; with ``capacity`` >= the device's in-flight
loads this is the same).
"""

from __future__ import annotations

from collections import OrderedDict


class SimDiskTier:
    """Host-cache residency and disk reads, in the simulator's virtual seconds."""

    def __init__(self, capacity: int, *, expert_bytes: int, disk_gbps: float, disk_latency_us: float,
                 warm: list[tuple[int, int]] = ()) -> None:
        if capacity < 1:
            raise ValueError(f"the simulated host cache needs at least one expert, got {capacity}")
        if not disk_gbps > 0:
            raise ValueError(f"disk bandwidth must be > 0 GB/s, got {disk_gbps}")
        self.capacity = capacity
        self.read_s = expert_bytes / (disk_gbps * 1e9)
        self.latency_s = disk_latency_us * 1e-6
        self.expert_bytes = expert_bytes
        self.ready: OrderedDict[tuple[int, int], float] = OrderedDict()  # key -> when it is in host memory
        self.disk_free = 0.0
        self.reads = 0
        self.busy_s = 0.0
        for key in list(warm)[:capacity]:
            self.ready[key] = 0.0

    def ready_at(self, key: tuple[int, int], now: float) -> tuple[float, float | None]:
        """(when ``key`` is in host memory, when its disk read started or None when it was cached)."""
        t = self.ready.get(key)
        if t is not None:
            self.ready.move_to_end(key)
            return t, None
        start = max(now, self.disk_free)
        self.disk_free = start + self.read_s
        end = start + self.read_s + self.latency_s
        self.reads += 1
        self.busy_s += self.read_s
        self.ready[key] = end
        while len(self.ready) > self.capacity:
            self.ready.popitem(last=False)
        return end, start

    @property
    def bytes_read(self) -> int:
        return self.reads * self.expert_bytes

    def reset_counters(self) -> None:
        self.reads, self.busy_s = 0, 0.0


def sim_disk_for(profile, host_experts: int | None, num_layers: int, num_experts: int) -> SimDiskTier | None:
    """The disk tier for a host cache of ``host_experts`` (None or all: no disk tier), warm-filled in the order the
    real store fills (expert 0 of every layer, then expert 1, ...). ProfileError without a disk in the profile."""
    from moeflow.sim.profile import ProfileError

    total = num_layers * num_experts
    if host_experts is None or host_experts >= total:
        return None
    if profile.disk_gbps is None:
        raise ProfileError(f"hardware profile {profile.name!r} has no disk_gbps: give --disk-gbps (or measure it "
                           "with `moeflow bench profile`) to simulate a host budget smaller than the model")
    order = [(i % num_layers, i // num_layers) for i in range(total)]
    return SimDiskTier(host_experts, expert_bytes=profile.expert_bytes, disk_gbps=profile.disk_gbps,
                       disk_latency_us=profile.disk_latency_us, warm=order[:host_experts])


def measure_disk(expert_bytes: int, directory: str | None = None, reads: int = 16,
                 max_file_bytes: int = 512 * 2**20) -> tuple[float, float, str]:
    """(cold read GB/s of expert-sized ranges, latency us of a cold 4 KiB read, how the cache was dropped).

    Writes a scratch file in ``directory`` (default: the temp directory; put it on the disk the checkpoints
    live on), evicts it from the page cache with ``posix_fadvise(DONTNEED)`` (unprivileged; the global
    drop_caches needs root) and reads it back with ``os.preadv``, the disk tier's read (docs/disk.md).
    """
    import os
    import random
    import tempfile
    import time

    import numpy as np

    size = min(max_file_bytes, max(4, reads) * expert_bytes)
    n = min(expert_bytes, size // 4)
    rng = random.Random(0)
    fd_path = tempfile.mkstemp(prefix="moeflow-disk-", dir=directory)
    os.close(fd_path[0])
    path = fd_path[1]
    try:
        with open(path, "wb") as f:
            block = np.random.default_rng(0).integers(0, 255, min(size, 2**24), dtype=np.uint8).tobytes()
            for at in range(0, size, len(block)):
                f.write(block[: size - at])
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            buf = memoryview(bytearray(n))
            offsets = [rng.randrange(0, (size - n) // 4096 + 1) * 4096 for _ in range(reads)]
            t0 = time.perf_counter()
            for off in offsets:
                os.preadv(fd, [buf], off)
            gbps = n * reads / (time.perf_counter() - t0) / 1e9
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            small = memoryview(bytearray(4096))
            lat = []
            for _ in range(reads):
                off = rng.randrange(0, size // 4096) * 4096
                t0 = time.perf_counter()
                os.preadv(fd, [small], off)
                lat.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        os.remove(path)
    lat.sort()
    return gbps, lat[len(lat) // 2] * 1e6, "posix_fadvise(DONTNEED) on a scratch file"
