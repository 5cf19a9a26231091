"""One gpt-oss-120b expert (H 2880, I 2880: w13 [5760, 2880], w2 [2880, 2880], MXFP4) on the CPU: the native
kernel on the host store's bytes (``moeflow/kernels/cpu/mxfp4.c``, :class:`Mxfp4NativeExpert`) against the torch
int4 digit form it replaces (:class:`Mxfp4CpuExpert`, 2.35x the bytes), in GB/s of the expert's MXFP4 bytes
(blocks + scales: what the native kernel reads; the digit form reads 2.35x as many), one thread by default.

    python -m benchmarks.cpu.mxfp4_native [--threads 1] [--reps 7] [--cold] \\
        > benchmarks/results/s16_cpu_mxfp4_native/table.md

``--cold``: 256 MB read between calls (not timed), so the expert's bytes come from DRAM as in a model's decode
step (the default, one expert called again and again, reads them from the L3 cache: 13 MB fits a Zen 4 CCD's).
Read, not written: a written buffer leaves the cache full of dirty lines whose write-backs share the kernel's DRAM
bandwidth (before s17 it was written: ~0.1-0.3 ms more per call). The roofline beside it: a plain read of the
same bytes (torch's max over them as int32), after the same flush.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch

from moeflow.kernels.cpu.mxfp4 import Mxfp4CpuExpert
from moeflow.kernels.cpu.mxfp4_native import Mxfp4NativeExpert
from moeflow.kernels.cpu.native import SIMD_NAMES, library
from moeflow.kernels.experts.biased import gate_activation
from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4
from moeflow.kernels.formats import biased_expert_format

H, I = 2880, 2880  # noqa: E741


def cpu_name() -> str:
    info = open("/proc/cpuinfo").read().splitlines()
    name = next(ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
    flags = next(ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags"))
    return f"{name}; flags: {' '.join(f for f in flags if f.startswith(('avx512', 'avx2', 'fma', 'gfni')))}"


def times_s(fn, reps: int, flush=None) -> tuple[float, float]:
    """(median, best) CPU seconds of the calling thread for ``fn`` over ``reps`` calls after one warm-up. One
    thread (``--threads 1``: the OpenMP team and torch's are the calling thread) on a shared, overloaded machine: a
    call's wall time is mostly waiting for a core, its thread time is what it computed."""
    fn()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush()
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="evict the caches between calls (256 MB written)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                               activation="clamped_swiglu")
    w13, w2 = torch.randn(2 * I, H, generator=g) * 0.02, torch.randn(H, I, generator=g) * 0.02
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    t = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
         "w13_bias": (torch.randn(2 * I, generator=g) * 0.1).bfloat16(),
         "w2_bias": (torch.randn(H, generator=g) * 0.1).bfloat16()}
    t0 = time.perf_counter()
    native = fmt.cpu_expert(t)  # written into a region of its own, computed there (a host store's: views)
    native_s = time.perf_counter() - t0
    assert isinstance(native, Mxfp4NativeExpert)
    t0 = time.perf_counter()
    digits = Mxfp4CpuExpert.from_tensors(t, fmt)
    digits_s = time.perf_counter() - t0
    mx_bytes = native.nbytes
    w13f, w2f = dequantize_mxfp4(b13, s13), dequantize_mxfp4(b2, s2)
    flat = torch.cat([b13.flatten(), s13.flatten(), b2.flatten(), s2.flatten()])
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    junk = torch.zeros(64 << 20) if args.cold else None
    flush = (lambda: junk.sum()) if args.cold else None
    words = flat[: flat.numel() // 4 * 4].view(torch.int32)
    read_s = times_s(lambda: words.max(), args.reps, flush)[1]
    small = biased_expert_format(kind="mxfp4", hidden_size=64, intermediate_size=64, dtype=torch.bfloat16,
                                 activation="clamped_swiglu")
    (sb13, ss13), (sb2, ss2) = quantize_mxfp4(torch.randn(128, 64, generator=g)), quantize_mxfp4(torch.randn(64, 64))
    tiny = small.cpu_expert({"w13_blocks": sb13, "w13_scales": ss13, "w2_blocks": sb2, "w2_scales": ss2,
                             "w13_bias": torch.zeros(128).bfloat16(), "w2_bias": torch.zeros(64).bfloat16()})
    x1 = torch.randn(1, 64, generator=g)
    call_s = times_s(lambda: tiny.forward(x1, torch.ones(1)), args.reps, flush)[1]
    cold = " --cold" if args.cold else ""
    print(f"# Native MXFP4 CPU expert vs torch's int4 digits, gpt-oss-120b expert shapes{cold}\n\n"
          f"`python -m benchmarks.cpu.mxfp4_native --threads {args.threads} --reps {args.reps}{cold}`\n\n"
          f"CPU: {cpu_name()}\n\nuptime: {load}\n\nkernels: {SIMD_NAMES[library().mf_simd()]} build "
          f"(MOEFLOW_CPU_ISA={os.environ.get('MOEFLOW_CPU_ISA', 'native')}); torch {torch.__version__}, "
          f"{args.threads} thread(s), "
          f"{args.reps} reps; os.cpu_count() {os.cpu_count()}\n")
    print(f"Expert MXFP4 bytes (blocks + scales, what the native kernel reads): {mx_bytes / 1e6:.1f} MB; digit form "
          f"{digits.nbytes / 1e6:.1f} MB ({digits.nbytes / mx_bytes:.2f}x). Reading the MXFP4 bytes once (a plain "
          f"read, best, {args.threads} thread(s){cold}): {read_s * 1e3:.2f} ms = {mx_bytes / read_s / 1e9:.1f} GB/s. "
          f"Building the form: "
          f"native {native_s * 1e3:.0f} ms (from loader tensors; 0 from a host store region), digits "
          f"{digits_s * 1e3:.0f} ms.\n")
    print(f"A call's own cost (an H = I = 64 expert, 1 token, best{cold}): {call_s * 1e3:.3f} ms: the Python, "
          "torch and ctypes code and data a call runs through, from DRAM after the flush; 'less the call' takes it "
          "off.\n")
    print("ms: the calling thread's CPU time (thread_time; wall time on this overloaded machine is mostly waiting), "
          "median / best of the reps; GB/s: the expert's MXFP4 bytes over the best.\n")
    print("| T | native ms | native GB/s | native GB/s less the call | native / plain read | digits ms | "
          "digits GB/s (of MXFP4 bytes) | native / digits speed (best) | native rel err vs fp32 | digits rel err "
          "vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in (1, 4, 8):
        x = torch.randn(T, H, generator=g)
        w = torch.ones(T)
        mn, tn = times_s(lambda x=x, w=w: native.forward(x, w), args.reps, flush)
        md, td = times_s(lambda x=x, w=w: digits.forward(x, w), args.reps, flush)
        want = gate_activation(x @ w13f.T + t["w13_bias"].float(), fmt) @ w2f.T + t["w2_bias"].float()
        err = {name: float((f.forward(x, w).float() - want).norm() / want.norm()) for name, f in
               (("native", native), ("digits", digits))}
        print(f"| {T} | {mn * 1e3:.2f} / {tn * 1e3:.2f} | {mx_bytes / tn / 1e9:.2f} | "
              f"{mx_bytes / max(tn - call_s, 1e-9) / 1e9:.2f} | {read_s / tn:.2f} | "
              f"{md * 1e3:.2f} / {td * 1e3:.2f} | "
              f"{mx_bytes / td / 1e9:.2f} | "
              f"{td / tn:.1f}x | {err['native']:.1e} | {err['digits']:.1e} |")


if __name__ == "__main__":
    main()
