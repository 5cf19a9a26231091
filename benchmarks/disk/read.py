"""Which way to read experts from disk: buffered pread, O_DIRECT pread, or a memory map, cold and warm.

Writes a file of ``--file-mb`` MiB, then reads ``--reads`` randomly chosen ``--expert-mb`` MiB ranges (an expert's
bytes) with each method, from one thread and from ``--threads`` threads. "cold" evicts the file from the page
cache first with ``posix_fadvise(DONTNEED)`` (works without root; dropping the whole cache through
/proc/sys/vm/drop_caches needs privileges a container usually lacks), "warm" reads it after a full read.
The result (JSON) is what docs/disk.md quotes for the choice moeflow makes.

    python -m benchmarks.disk.read --out benchmarks/results/disk/read_methods.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ALIGN = 4096


def drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def aligned_buffer(nbytes: int) -> memoryview:
    raw = mmap.mmap(-1, nbytes + ALIGN)  # anonymous maps are page aligned
    return memoryview(raw)[:nbytes]


def timed_reads(one, ranges: list[tuple[int, int]], threads: int) -> float:
    """Seconds to run ``one((i, range))`` over every range, from ``threads`` threads."""
    t0 = time.perf_counter()
    if threads == 1:
        for item in enumerate(ranges):
            one(item)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, enumerate(ranges)))
    return time.perf_counter() - t0


def read_pread(path: str, ranges: list[tuple[int, int]], threads: int, direct: bool) -> float:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    length = ranges[0][1]
    bufs = [aligned_buffer(length + 2 * ALIGN) for _ in range(threads)]

    def one(i_rng):
        i, (offset, n) = i_rng
        buf = bufs[i % threads]
        if direct:  # O_DIRECT: offset, length and buffer aligned to the block size
            a = offset // ALIGN * ALIGN
            b = -(-(offset + n) // ALIGN) * ALIGN
            got = os.preadv(fd, [buf[: b - a]], a)
            assert got >= offset + n - a
        else:
            assert os.preadv(fd, [buf[:n]], offset) == n

    dt = timed_reads(one, ranges, threads)
    os.close(fd)
    return dt


def read_mmap(path: str, ranges: list[tuple[int, int]], threads: int) -> float:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    length = ranges[0][1]
    bufs = [np.empty(length, dtype=np.uint8) for _ in range(threads)]

    def one(i_rng):
        i, (offset, n) = i_rng
        bufs[i % threads][:n] = arr[offset : offset + n]  # page faults pull the file in

    dt = timed_reads(one, ranges, threads)
    arr = None  # release the exported buffer before closing the map
    mm.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/moeflow-disk-bench")
    ap.add_argument("--file-mb", type=int, default=1024)
    ap.add_argument("--expert-mb", type=float, default=8.0)
    ap.add_argument("--reads", type=int, default=48)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "experts.bin")
    size = args.file_mb * 2**20
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            chunk = np.random.default_rng(0).integers(0, 255, 2**24, dtype=np.uint8).tobytes()
            for _ in range(size // len(chunk)):
                f.write(chunk)
    n = int(args.expert_mb * 2**20)
    rng = random.Random(0)
    # safetensors offsets are not page aligned: start each range at an odd 8-byte offset
    ranges = [(rng.randrange(0, (size - n - ALIGN) // 8) * 8 + 8, n) for _ in range(args.reads)]
    results = []
    for threads in (1, args.threads):
        for method in ("pread", "o_direct", "mmap"):
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop_file_cache(path)
                else:
                    read_pread(path, [(0, size // 64)] * 1, 1, False)  # touch
                    with open(path, "rb") as f:
                        while f.read(2**24):
                            pass
                if method == "mmap":
                    dt = read_mmap(path, ranges, threads)
                else:
                    dt = read_pread(path, ranges, threads, method == "o_direct")
                gbps = n * len(ranges) / dt / 1e9
                results.append({"method": method, "cache": cache, "threads": threads, "GB/s": round(gbps, 3),
                                "ms_per_expert": round(dt / len(ranges) * 1e3, 3)})
                print(f"{method:9s} {cache:5s} threads={threads}: {gbps:6.2f} GB/s, "
                      f"{dt / len(ranges) * 1e3:7.2f} ms per {args.expert_mb} MiB expert")
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "file_mb": args.file_mb,
              "expert_mb": args.expert_mb, "reads": args.reads, "page_cache_drop": "posix_fadvise(DONTNEED) per file",
              "results": results}
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    os.remove(path)


if __name__ == "__main__":
    main()
