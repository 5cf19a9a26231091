"""Extra RAM per expert computed on the CPU (hybrid compute): the resident set size a host store gains when
:meth:`HostStore.cpu_expert` builds the CPU form of each of its experts (what ``HybridCompute.prepare`` does for
every expert when loading finishes), as a multiple of the experts' stored bytes, for AWQ, MXFP4 and GGUF experts.

Each format runs in a fresh process: a host store of ``--experts`` experts at a real model's shapes (AWQ and GGUF
Q4_K_M: Qwen3-30B-A3B's H 2048, I 768; MXFP4: gpt-oss's H = I = 2880) filled with random bytes (the CPU forms'
sizes do not depend on the values), then VmRSS before and after building every CPU form, again after
:func:`~moeflow.offload.hybrid.release_freed_heap` (glibc's ``malloc_trim``, which ``prepare`` calls after
converting), and the store's ``cpu_nbytes`` (the bytes it says it holds).

    PYTHONPATH=$PWD python -m benchmarks.host.cpu_form_rss [--experts 12] > benchmarks/results/cpu_form_rss/table.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch

FORMATS = ("awq", "mxfp4", "gguf")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _fmt_and_tensors(kind: str, gen: torch.Generator):
    from moeflow.kernels.formats import AWQFormat, biased_expert_format, gguf_expert_format

    if kind == "awq":
        fmt = AWQFormat(2048, 768, torch.float16, 128)
    elif kind == "mxfp4":
        fmt = biased_expert_format(2880, 2880, "mxfp4", torch.bfloat16)
    else:
        fmt = gguf_expert_format("Q4_K", "Q6_K", 2048, 768, torch.float32)

    def tensors() -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in fmt.loader_shapes().items():
            if kind == "gguf":
                out[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            elif name.endswith("scales") and kind == "awq":
                out[name] = (torch.rand(shape, generator=gen) * 0.01).to(fmt.dtype)
            elif kind == "awq":
                out[name] = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)
            elif name.endswith("bias"):
                out[name] = torch.randn(shape, generator=gen).to(fmt.dtype)
            elif name.endswith("scales"):
                out[name] = torch.randint(118, 130, shape, generator=gen, dtype=torch.uint8)
            else:
                out[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        return out
    return fmt, tensors


def measure(kind: str, experts: int) -> dict:
    """One format in this process: RSS gained building the CPU forms of ``experts`` stored experts."""
    from moeflow.offload.host_store import HostStore
    from moeflow.offload.hybrid import release_freed_heap

    gen = torch.Generator().manual_seed(0)
    fmt, tensors = _fmt_and_tensors(kind, gen)
    store = HostStore(fmt, 1, experts, pin=False, device="cpu")
    for e in range(experts):
        store.write(0, e, tensors())
    gc.collect()
    release_freed_heap()  # the writes' temporaries out of the count
    before = rss_bytes()
    forms = [store.cpu_expert(0, e) for e in range(experts)]
    gc.collect()
    after = rss_bytes()
    release_freed_heap()  # what HybridCompute.prepare does after converting
    trimmed = rss_bytes()
    region = experts * fmt.nbytes
    return {"format": kind, "experts": experts, "region_bytes": fmt.nbytes, "rss_gain": after - before,
            "rss_gain_x": (after - before) / region, "trimmed_x": (trimmed - before) / region,
            "cpu_nbytes_x": store.cpu_nbytes / region, "forms": type(forms[0]).__name__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=12)
    p.add_argument("--one", choices=FORMATS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.experts)))
        return
    rows = []
    for kind in FORMATS:
        r = subprocess.run([sys.executable, "-m", "benchmarks.host.cpu_form_rss", "--one", kind, "--experts",
                            str(a.experts)], capture_output=True, text=True, check=True, env=os.environ)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    print(f"CPU: {cpu}; load: {os.getloadavg()[0]:.1f} (1 min); torch {torch.__version__}\n")
    flags = " ".join(sorted({w for w in open("/proc/cpuinfo").read().split() if w.startswith("avx512")}))
    print(f"flags: {flags}\n")
    print("| format | experts | region MiB | RSS gain | RSS gain / stored bytes | after release_freed_heap | "
          "cpu_nbytes / stored | form |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['experts']} | {r['region_bytes'] / 2**20:.2f} | "
              f"{r['rss_gain'] / 2**20:.1f} MiB | {r['rss_gain_x']:.2f}x | {r['trimmed_x']:.2f}x | "
              f"{r['cpu_nbytes_x']:.2f}x | {r['forms']} |")


if __name__ == "__main__":
    main()
