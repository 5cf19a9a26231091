"""How the order in which ``mxfp4.c`` walks an expert's region sets its speed from DRAM: a plain load loop (no
arithmetic) over one gpt-oss-120b expert's MXFP4 bytes (w13 [5760, 2880] and w2 [2880, 2880], blocks in 64-input
panels of N x 32 bytes, scales N x 2) in the kernel's order, tiles of R rows each read panel by panel (one run of
R x 32 bytes per panel, the panels N x 32 bytes apart), against the bytes read front to back. With and without a
prefetch of the next panel's run into L2 (``_mm_prefetch(..., _MM_HINT_T1)``, what the kernel issues since s17) or
into L1 four panels on (before s17).
One thread, 256 MB read between reps (the bytes come from DRAM), configurations alternated within each rep; the
C source is compiled on the spot (``$CC`` or gcc, ``-O3 -march=native``; x86-64 with AVX-512F).

    python -m benchmarks.cpu.mxfp4_read_order [--reps 9] > benchmarks/results/s17_cpu_mxfp4_bw/read_order.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.cpu.mxfp4_native import cpu_name

PREFETCH = {"0": "none", "1": "the next panel's run into L2 (s17)", "2": "into L1, four panels on (before s17)"}

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int cmp(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}
static unsigned char* buf(size_t n) {
    void* p = NULL;
    if (posix_memalign(&p, 4096, n)) exit(1);
    memset(p, 1, n);
    return p;
}
/* rows per tile R (0: front to back); pf 1: prefetch the next panel's run into L2, 2: into L1 four panels on (the
   kernel before s17) */
static __m512i walk(const unsigned char* b, const unsigned char* s, int N, int K, int R, int pf) {
    __m512i a = _mm512_setzero_si512(), c = a;
    const int np = K / 64;
    if (!R) {
        for (size_t i = 0; i + 128 <= (size_t)N * K / 2; i += 128)
            a = _mm512_add_epi64(a, _mm512_loadu_si512(b + i)), c = _mm512_add_epi64(c, _mm512_loadu_si512(b + i + 64));
        for (size_t i = 0; i + 64 <= (size_t)N * K / 32; i += 64) a = _mm512_add_epi64(a, _mm512_loadu_si512(s + i));
        return _mm512_add_epi64(a, c);
    }
    for (int n0 = 0; n0 < N; n0 += R) {
        const int nr = N - n0 < R ? N - n0 : R;
        for (int p = 0; p < np; p++) {
            const unsigned char* q = b + (size_t)p * N * 32 + (size_t)n0 * 32;
            const unsigned char* sc = s + (size_t)p * N * 2 + (size_t)n0 * 2;
            for (int i = 0; i + 128 <= nr * 32; i += 128) {
                if (pf == 1 && p + 1 < np) {
                    _mm_prefetch((const char*)q + i + (size_t)N * 32, _MM_HINT_T1);
                    _mm_prefetch((const char*)q + i + 64 + (size_t)N * 32, _MM_HINT_T1);
                } else if (pf == 2 && p + 4 < np) {
                    _mm_prefetch((const char*)q + i + (size_t)N * 128, _MM_HINT_T0);
                    _mm_prefetch((const char*)q + i + 64 + (size_t)N * 128, _MM_HINT_T0);
                }
                a = _mm512_add_epi64(a, _mm512_loadu_si512(q + i));
                c = _mm512_add_epi64(c, _mm512_loadu_si512(q + i + 64));
            }
            for (int i = 0; i + 64 <= nr * 2; i += 64) {
                if (pf == 1 && p + 1 < np) _mm_prefetch((const char*)sc + i + (size_t)N * 2, _MM_HINT_T1);
                else if (pf == 2 && p + 4 < np) _mm_prefetch((const char*)sc + i + (size_t)N * 8, _MM_HINT_T0);
                a = _mm512_add_epi64(a, _mm512_loadu_si512(sc + i));
            }
        }
    }
    return _mm512_add_epi64(a, c);
}
int main(int argc, char** argv) {
    const int reps = atoi(argv[1]), shape[2][2] = {{5760, 2880}, {2880, 2880}};
    const int cfg[][2] = {{0, 0}, {128, 0}, {256, 0}, {512, 0}, {2048, 0}, {6000, 0},
                          {128, 2}, {128, 1}, {512, 1}, {2048, 1}};
    const int nc = sizeof cfg / sizeof cfg[0];
    const size_t jn = (size_t)256 << 20;
    unsigned char *junk = buf(jn), *b[2], *s[2];
    size_t total = 0;
    for (int m = 0; m < 2; m++) {
        const size_t nb = (size_t)shape[m][0] * shape[m][1] / 2, ns = nb / 16;
        b[m] = buf(nb), s[m] = buf(ns), total += nb + ns;
    }
    double* t = calloc((size_t)nc * reps, sizeof(double));
    long long sink = 0;
    for (int r = 0; r < reps; r++)
        for (int c = 0; c < nc; c++) {
            for (int m = 0; m < 2; m++) {
                __m512i f = _mm512_setzero_si512();
                for (size_t i = 0; i < jn; i += 64) f = _mm512_add_epi64(f, _mm512_loadu_si512(junk + i));
                sink += _mm512_reduce_add_epi64(f);
                const double t0 = now();
                sink += _mm512_reduce_add_epi64(walk(b[m], s[m], shape[m][0], shape[m][1], cfg[c][0], cfg[c][1]));
                t[c * reps + r] += now() - t0;
            }
        }
    for (int c = 0; c < nc; c++) {
        qsort(t + c * reps, reps, sizeof(double), cmp);
        const double med = t[c * reps + reps / 2], best = t[c * reps];
        printf("%d %d %.6f %.6f %.4f\n", cfg[c][0], cfg[c][1], med, best, total / best / 1e9);
    }
    return sink == 42;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("no C compiler (set CC, or install gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "read_order.c", Path(tmp) / "read_order"
        src.write_text(SOURCE)
        subprocess.run([cc, "-O3", "-march=native", str(src), "-o", str(exe)], check=True)
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        out = subprocess.run([str(exe), str(args.reps)], capture_output=True, text=True, check=True).stdout
    print(f"# Reading one gpt-oss-120b expert's MXFP4 bytes (13.2 MB) from DRAM in mxfp4.c's orders, one thread\n\n"
          f"`python -m benchmarks.cpu.mxfp4_read_order --reps {args.reps}`\n\nCPU: {cpu_name()}\n\nuptime: {load}\n\n"
          "A plain load loop, no arithmetic; the thread's CPU time, median / best of the reps; GB/s over the best.\n")
    print("| order | run per panel | prefetch | ms | GB/s |")
    print("|---|---|---|---|---|")
    for line in out.split("\n"):
        if not line.strip():
            continue
        rows, pf, med, best, gbs = line.split()
        order = "front to back" if rows == "0" else f"tiles of {rows} rows" if rows != "6000" else "whole panels"
        run = "-" if rows == "0" else f"{min(int(rows), 5760) * 32 // 1024} KB (w13)"
        print(f"| {order} | {run} | {PREFETCH[pf]} | {float(med) * 1e3:.2f} / {float(best) * 1e3:.2f} "
              f"| {float(gbs):.1f} |")


if __name__ == "__main__":
    main()
