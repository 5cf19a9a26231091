"""GGUF experts on the CPU (``moeflow/kernels/cpu/gguf.c``) against memory bandwidth: GB/s of expert bytes read
per block-type mix, at T tokens and a thread count, beside this machine's streaming read bandwidth
(``benchmarks/peers/cpu_roofline.c``) and moeflow's group-32 int4 kernel (q4.c) at the same shape.

    python -m benchmarks cpu.gguf_experts --threads 1 --out benchmarks/results/peers/s15/kquant_micro_t1

Each figure is the best of ``--reps`` passes over ``--experts`` distinct experts (more bytes than the caches hold,
so every pass reads from memory); the passes of every kernel alternate, so the shared machine's load hits all
alike, and ``uptime`` is recorded before and after. Default shape: Qwen3-30B-A3B's experts (hidden 2048,
intermediate 768), whose Q4_K_M files hold Q4_K gate/up with Q6_K or Q4_K down.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers.cpu_roofline import measure
from benchmarks.peers.peer_report import uptime, write_report
from moeflow.kernels.cpu import native as cn
from moeflow.kernels.cpu import q4_matrix as qm
from moeflow.kernels.cpu.gguf import GGUFCpuExpert
from moeflow.kernels.experts.gguf_reference import ggml_type

MIXES = (("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q5_K", "Q5_K"), ("Q6_K", "Q6_K"), ("Q8_0", "Q8_0"))
FP16_AT = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks(kind: str, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks uint8 [rows, row_bytes] with small finite fp16 scales (the speed does not depend on values)."""
    t = ggml_type(kind)
    b = torch.randint(0, 256, (rows, k // t.block_size, t.type_size), generator=gen, dtype=torch.uint8)
    for off in FP16_AT[kind]:
        b[..., off : off + 2] = (torch.rand(rows, k // t.block_size, generator=gen) * 1e-3).half().view(
            torch.uint8).view(rows, -1, 2)
    return b.reshape(rows, -1)


def q4_expert(h: int, i: int, gen: torch.Generator):
    g = 32

    def mat(n: int, k: int) -> qm.Q4Matrix:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        s = (torch.rand(n, k // g, generator=gen) * 1e-2).half()
        z = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)
        return qm.Q4Matrix(qm.pack_q4(q), qm.group_rows(s), qm.group_rows(z), g)

    return mat(2 * i, h), mat(h, i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=48, help="distinct experts per pass (bytes beyond the caches)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, help="output prefix (.json and .md are added)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    H, I, n = args.hidden, args.inter, args.experts  # noqa: E741
    gen = torch.Generator().manual_seed(0)
    sets = {f"{a}/{b}": [GGUFCpuExpert(blocks(a, I, H, gen), blocks(a, I, H, gen), blocks(b, H, I, gen),
                                       ggml_type(a), ggml_type(b)) for _ in range(n)] for a, b in MIXES}
    q4 = [q4_expert(H, I, gen) for _ in range(n)]
    nbytes = {k: v[0].nbytes for k, v in sets.items()}
    nbytes["q4 g32 (moeflow int4, AWQ form)"] = q4[0][0].nbytes + q4[0][1].nbytes
    loads = [uptime()]
    best: dict[str, dict[int, float]] = {k: {t: 0.0 for t in args.tokens} for k in nbytes}
    stream = 0.0
    calls: dict[str, dict[int, list[float]]] = {k: {t: [] for t in args.tokens} for k in nbytes}
    for _ in range(args.reps):
        stream = max(stream, measure(1)[0]["stream_read_gbps_1_thread"])
        for t in args.tokens:
            x, w = torch.randn(t, H, generator=gen), torch.ones(t)
            runs = {name: [lambda e=e, x=x, w=w: e.forward(x, w) for e in experts] for name, experts in sets.items()}
            runs["q4 g32 (moeflow int4, AWQ form)"] = [lambda a=a, b=b, x=x, w=w: qm.q4_expert(x, a, b, w)
                                                       for a, b in q4]
            for name, fns in runs.items():
                t0 = time.perf_counter()
                for fn in fns:  # each call's CPU time too: a descheduled call is not charged for the wait
                    c0 = time.thread_time()
                    fn()
                    calls[name][t].append(time.thread_time() - c0)
                best[name][t] = max(best[name][t], nbytes[name] * n / (time.perf_counter() - t0) / 1e9)
        loads.append(uptime())
    median = {k: {t: nbytes[k] / statistics.median(v[t]) / 1e9 for t in args.tokens} for k, v in calls.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    flags = sorted({f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
                    for f in ln.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx"))})
    simd = cn.SIMD_NAMES[cn.library().mf_simd()]
    res = {"hidden": H, "intermediate": I, "experts_per_pass": n, "threads": args.threads, "reps": args.reps,
           "cpu": cpu, "cpu_flags": flags, "nproc": os.cpu_count(), "kernels": simd,
           "source_digest": cn.source_digest(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "uptime": loads, "stream_read_gbps_1_thread": stream, "expert_bytes": nbytes, "gbps": best,
           "gbps_median_call_cpu_time": median}
    lines = [f"GGUF experts on the CPU (moeflow `kernels/cpu/gguf.c`, {simd}), hidden {H}, intermediate {I}, "
             f"{args.threads} thread(s), best of {args.reps} passes over {n} experts, {res['date']}. Machine "
             "shared (numbers as loaded):", "",
             f"CPU: {cpu} ({os.cpu_count()} cores seen), flags: {' '.join(flags)}  ",
             *[f"uptime: `{u}`  " for u in (loads[0], loads[-1])],
             f"streaming read, 1 thread (cpu_roofline.c): **{stream:.1f} GB/s**", "",
             "GB/s: best pass over the experts (wall time); in brackets, from the median expert call's CPU time "
             "(`time.thread_time`: robust to a shared machine's descheduling).", "",
             "| experts (gate+up / down) | MB per expert | " + " | ".join(f"GB/s T={t}" for t in args.tokens)
             + " | T=1 vs stream read |", "|---|---|" + "---|" * len(args.tokens) + "---|"]
    for name, by_t in best.items():
        lines.append(f"| {name} | {nbytes[name] / 1e6:.2f} | "
                     + " | ".join(f"{by_t[t]:.2f} ({median[name][t]:.2f})" for t in args.tokens)
                     + f" | {by_t[args.tokens[0]] / stream:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
