"""One int4 expert in moeflow's q4 forms on the CPU (``moeflow/kernels/cpu/q4.c`` for AWQ group 128, ``q4z.c`` for
group 32: GGUF Q4_0 and AWQ group 32 with its zero points) from DRAM, against a plain read of the same bytes
(issue 42): Mixtral-8x7B's expert (H 4096, I 14336: w13 [28672, 4096], w2 [4096, 14336]) and the peer benchmark's
synthetic Mixtral (H 1024, I 3584). :func:`moeflow.kernels.cpu.q4_matrix.q4_expert` at T tokens, 256 MB read
between calls (not timed) so the expert's bytes come from DRAM as in a model's decode step; the roofline beside
it: the expert's tensors read by torch (max over them as int32) after the same flush. One thread by default; the
calling thread's CPU time (``time.thread_time``: on a shared machine wall time is mostly waiting for a core).

    python -m benchmarks.cpu.q4_cold [--shapes mixtral synthetic] [--forms awq128 q4_0 awq32] [--tokens 1 4 8 32]
        [--reps 7] [--before /work/main] > benchmarks/results/s17_cpu_q4_bw/table.md

``--before TREE``: also that tree's kernels (its ``moeflow/kernels/cpu`` sources compiled as ``native.py`` builds
them, the same flags and ``$MOEFLOW_CPU_ISA``), called alternately with this tree's in the same reps (rep by rep:
read, this tree, that tree), and whether the two give the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cpu.mxfp4_native import cpu_name
from moeflow.kernels.cpu import native
from moeflow.kernels.cpu.native import SIMD_NAMES, library
from moeflow.kernels.cpu.q4_matrix import Q4Matrix

SHAPES = {"mixtral": (4096, 14336), "synthetic": (1024, 3584)}
FORMS = {"awq128": "AWQ group 128 (q4.c, fp16 scales + uint8 zeros)",
         "q4_0": "GGUF Q4_0 (q4z.c, fp16 scales, zeros 8)",
         "awq32": "AWQ group 32 (q4z.c, fp16 scales + uint8 zeros)"}


def awq_matrix(n: int, k: int, group: int, gen: torch.Generator, zero8: bool = False) -> Q4Matrix:
    """A random AWQ matrix W [n, k] (fp16 scales; every zero point 8 with ``zero8``) in the q4 form."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    if zero8:
        qzeros = torch.full((k // group, n // 8), 0x88888888 - 2**32, dtype=torch.int64).to(torch.int32)
    else:
        qzeros = torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), generator=gen, dtype=torch.int64)
        qzeros = qzeros.to(torch.int32)
    scales = (torch.rand((k // group, n), generator=gen) * 2e-3 + 1e-3).half()
    return Q4Matrix.from_awq(qweight, qzeros, scales, group)


def expert(shape: str, form: str, gen: torch.Generator) -> tuple[Q4Matrix, Q4Matrix]:
    """(w13 [2I, H], w2 [H, I]) of one expert of ``shape`` in ``form``."""
    h, i = SHAPES[shape]
    group = 128 if form == "awq128" else 32
    zero8 = form == "q4_0"
    return awq_matrix(2 * i, h, group, gen, zero8), awq_matrix(h, i, group, gen, zero8)


def tensors(m: Q4Matrix) -> list[torch.Tensor]:
    return [t for t in (m.packed, m.scales, m.mins) if t.numel()]


def tree_library(tree: Path, out: Path) -> ctypes.CDLL:
    """The kernels of another source tree (``tree/moeflow/kernels/cpu``), built with this tree's flags for the ISA
    ``$MOEFLOW_CPU_ISA`` picks (default native) into ``out``."""
    src = tree / "moeflow" / "kernels" / "cpu"
    files = [str(src / f.name) for f in native.SOURCES if (src / f.name).is_file()]
    if not files:
        raise SystemExit(f"--before {tree}: no kernel sources under {src}")
    cc = os.environ.get("CC") or "gcc"
    lib = out / "before.so"
    isa = native.ISA_FLAGS[os.environ.get("MOEFLOW_CPU_ISA", "native")]
    flags = ["-O3", *isa, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([cc, *flags, *files, "-o", str(lib), "-lm"], check=True)
    return native.load(lib)


def call(lib: ctypes.CDLL, x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, w: torch.Tensor) -> torch.Tensor:
    """``q4_matrix.q4_expert`` (x fp32 [T, H], routing weights w fp32 [T] -> fp32 [T, H]) on the library ``lib``."""
    h, inter = w2.shape
    out = torch.empty((x.shape[0], h), dtype=torch.float32)
    native.check_rc(lib.mf_q4_expert(
        x.data_ptr(), x.shape[0], h, inter, w13.group_size, w13.fmt, w13.packed.data_ptr(), w13.scales.data_ptr(),
        w13.mins.data_ptr(), w2.packed.data_ptr(), w2.scales.data_ptr(), w2.mins.data_ptr(), w.data_ptr(),
        out.data_ptr(), 0, torch.get_num_threads()), "q4 expert")
    return out


def alternate(fns: list, reps: int, flush) -> list[list[float]]:
    """Per function, the calling thread's CPU seconds of ``reps`` calls, each after ``flush``, the functions
    alternated rep by rep (one warm-up call each first)."""
    for fn in fns:
        fn()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, ts, strict=True):
            flush()
            t0 = time.thread_time()
            fn()
            t.append(time.thread_time() - t0)
    return [sorted(t) for t in ts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another source tree whose kernels run alternately")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    junk = torch.zeros(64 << 20)  # 256 MB, read (not written) between calls

    def flush() -> None:
        junk.sum()

    tmp = tempfile.TemporaryDirectory()
    libs = {"this tree": library()}
    if args.before is not None:
        libs["before"] = tree_library(args.before, Path(tmp.name))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    before = f" --before {args.before}" if args.before else ""
    print(f"# int4 (q4 / q4z) expert from DRAM vs a plain read of its bytes\n\n"
          f"`python -m benchmarks.cpu.q4_cold --shapes {' '.join(args.shapes)} --forms {' '.join(args.forms)} "
          f"--tokens {' '.join(map(str, args.tokens))} --threads {args.threads} --reps {args.reps}{before}`\n\n"
          f"CPU: {cpu_name()}\n\nuptime (start): {load}\n\nkernels: {SIMD_NAMES[library().mf_simd()]} build "
          f"(MOEFLOW_CPU_ISA={os.environ.get('MOEFLOW_CPU_ISA', 'native')}); {args.threads} thread(s), "
          f"{args.reps} reps, 256 MB read before each call, alternated rep by rep.\n\n"
          "ms: the calling thread's CPU time, median / best; GB/s over the best; 'vs read': the plain read's best "
          "time over the kernel's best (1.00: at the read's rate).\n")
    cols = " | ".join(f"{n} ms | {n} GB/s | {n} vs read" for n in libs)
    print(f"| shape | form | MB | plain read ms (GB/s) | T | {cols} |" + (" same bits |" if len(libs) > 1 else ""))
    print("|---" * (5 + 3 * len(libs) + (len(libs) > 1)) + "|")
    for shape in args.shapes:
        h, _ = SHAPES[shape]
        for form in args.forms:
            w13, w2 = expert(shape, form, gen)
            ts = tensors(w13) + tensors(w2)
            nbytes = sum(t.numel() * t.element_size() for t in ts)
            words = [t.view(torch.uint8).reshape(-1).view(torch.int32) for t in ts]
            for T in args.tokens:
                x, wt = torch.randn(T, h, generator=gen), torch.ones(T)
                fns = [lambda words=words: [w.max() for w in words]]
                fns += [lambda lib=lib, x=x, wt=wt, a=w13, b=w2: call(lib, x, a, b, wt) for lib in libs.values()]
                read, *kern = alternate(fns, args.reps, flush)
                r = read[0]
                line = f"| {shape} | {form} | {nbytes / 1e6:.1f} | {r * 1e3:.2f} ({nbytes / r / 1e9:.1f}) | {T} |"
                for k in kern:
                    line += (f" {k[len(k) // 2] * 1e3:.2f} / {k[0] * 1e3:.2f} | {nbytes / k[0] / 1e9:.1f} | "
                             f"{r / k[0]:.2f} |")
                if len(libs) > 1:
                    outs = [call(lib, x, w13, w2, wt) for lib in libs.values()]
                    line += f" {all(torch.equal(outs[0], o) for o in outs[1:])} |"
                print(line, flush=True)
    print(f"\nuptime (end): {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
