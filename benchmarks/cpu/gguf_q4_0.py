"""GGUF Q4_0 experts on the CPU, two kernels over the same weights, paired: ``gguf.c``'s kernel on the file's
18-byte blocks as stored (what a mapped expert can use) against moeflow's q4 kernel on the ``Q4_F16Z8`` form made
from them at load (``q4z.c``: codes in 8-row groups, scales apart; what Q4_0 experts resident on the CPU run today).

    python -m benchmarks cpu.gguf_q4_0 --out benchmarks/results/cpu/gguf_q4_0_t1

Per shape (Qwen3-30B-A3B's experts, hidden 2048 / intermediate 768; Mixtral's, 4096 / 14336) and token count,
the two kernels' calls alternate expert by expert over more experts than the caches hold; the figure is GB/s of
expert bytes (both forms read 18 bytes per 32 weights) from the median call's CPU time (``time.thread_time``:
robust to a shared machine's descheduling), with ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cpu.gguf_experts import blocks
from benchmarks.peers.peer_report import uptime, write_report
from moeflow.kernels.cpu import native as cn
from moeflow.kernels.cpu import q4_matrix as qm
from moeflow.kernels.cpu.gguf import GGUFCpuExpert
from moeflow.kernels.experts.gguf_reference import ggml_type
from moeflow.quant.ggml import q4_0_codes

SHAPES = {"qwen3-30b-a3b": (2048, 768, 48), "mixtral-8x7b": (4096, 14336, 3)}  # hidden, intermediate, experts


def _cpu_time(fn) -> float:
    c0 = time.thread_time()
    fn()
    return time.thread_time() - c0


def run(h: int, i: int, n: int, tokens: list[int], reps: int, gen: torch.Generator) -> dict:  # noqa: E741
    q40 = ggml_type("Q4_0")
    stored, q4z = [], []
    for _ in range(n):
        gate, up, down = blocks("Q4_0", i, h, gen), blocks("Q4_0", i, h, gen), blocks("Q4_0", h, i, gen)
        stored.append(GGUFCpuExpert(gate, up, down, q40, q40))
        q4z.append((qm.Q4Matrix.from_q4_0(*q4_0_codes(torch.cat([gate, up]))),
                    qm.Q4Matrix.from_q4_0(*q4_0_codes(down))))
    nbytes = stored[0].nbytes
    out = {}
    for t in tokens:
        x, w = torch.randn(t, h, generator=gen), torch.ones(t)
        a, b = [], []
        for _ in range(reps):
            for e, (w13, w2) in zip(stored, q4z, strict=True):
                a.append(_cpu_time(lambda e=e, x=x, w=w: e.forward(x, w)))
                b.append(_cpu_time(lambda w13=w13, w2=w2, x=x, w=w: qm.q4_expert(x, w13, w2, w)))
        ga, gb = nbytes / statistics.median(a) / 1e9, nbytes / statistics.median(b) / 1e9
        out[t] = {"stored_q4_0_gbps": ga, "q4z_gbps": gb, "ratio": ga / gb}
    return {"expert_bytes": nbytes, "by_tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="output prefix (.json and .md are added)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    loads = [uptime()]
    results = {}
    for s in args.shapes:
        results[s] = run(*SHAPES[s], args.tokens, args.reps, gen)
        loads.append(uptime())
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = sorted({f for ln in info if ln.startswith("flags") for f in ln.split(":", 1)[1].split()
                    if f.startswith(("avx", "fma", "f16c", "amx"))})
    simd = cn.SIMD_NAMES[cn.library().mf_simd()]
    res = {"cpu": cpu, "cpu_flags": flags, "nproc": os.cpu_count(), "kernels": simd, "threads": args.threads,
           "reps": args.reps, "source_digest": cn.source_digest(), "uptime": loads, "shapes": results,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    lines = [f"GGUF Q4_0 experts on the CPU ({simd}, {args.threads} thread(s), {res['date']}): the stored 18-byte "
             "blocks (gguf.c) against the Q4_F16Z8 form of the same weights (q4z.c), calls alternating, GB/s from "
             "the median call's CPU time. Machine shared (numbers as loaded).", "",
             f"CPU: {cpu} ({os.cpu_count()} cores seen), flags: {' '.join(flags)}  ",
             *[f"uptime: `{u}`  " for u in loads], "",
             "| shape | MB per expert | tokens | stored Q4_0 GB/s | q4z GB/s | stored / q4z |",
             "|---|---|---|---|---|---|"]
    for s, r in results.items():
        for t, v in r["by_tokens"].items():
            lines.append(f"| {s} | {r['expert_bytes'] / 1e6:.2f} | {t} | {v['stored_q4_0_gbps']:.2f} | "
                         f"{v['q4z_gbps']:.2f} | {v['ratio']:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
