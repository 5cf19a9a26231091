"""A GGUF ``lm_head`` on the file's blocks (``kernels/cpu/gguf.c``; ``--type``, default Q6_K) against moeflow's int8
head of the same matrix (``quantize_rows_int8``, q8.c), one token, from memory: the bytes and time of one decode
step's largest read; and the load's cost of the int8 head (the file's blocks dequantized, then int8: what a GGUF
load did before it took the blocks; the blocks themselves are taken as read).

    python -m benchmarks cpu.gguf_lm_head --out benchmarks/results/peers/s16/lm_head_q6k
    python -m benchmarks cpu.gguf_lm_head --type Q8_0 --hidden 2880 \\
        --out benchmarks/results/peers/s18/stored_lm_head_q8_0

Each call reads one of ``--copies`` distinct matrices (more bytes than the caches hold); the two kernels alternate
call by call; each call's CPU time (``time.thread_time``: a descheduled call is not charged for the wait, so a
10 ms call and a 2 ms one compare fairly on a shared machine) and its wall time, medians, with ``uptime``.
Default shape: the synthetic Mixtral of the peer benchmark (vocab 32000, hidden 1024).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cpu.gguf_experts import blocks
from benchmarks.peers.peer_report import uptime, write_report
from moeflow.engine.cpu_linears import quantize_rows_int8
from moeflow.kernels.cpu.gguf import gguf_linear
from moeflow.kernels.experts.gguf_reference import ggml_type
from moeflow.quant.ggml import dequantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--type", default="Q6_K", help="the file's block type (Q8_0, Q4_K, Q5_K, Q6_K)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    kind = args.type
    stored = [blocks(kind, args.vocab, args.hidden, gen) for _ in range(args.copies)]
    loads = [uptime()]
    i8, build_s = [], []
    for w in stored:  # the load's int8 head: the reader's dequantize, then quantize_rows_int8
        t0 = time.process_time()
        i8.append(quantize_rows_int8(dequantize(w, ggml_type(kind).type_id).reshape(args.vocab, args.hidden)))
        build_s.append(time.process_time() - t0)
    x = torch.randn(1, args.hidden, generator=gen)
    mine = f"{kind} (file blocks, gguf.c)"
    times: dict[str, list[float]] = {mine: [], "int8 (q8.c)": []}
    cpu_s: dict[str, list[float]] = {k: [] for k in times}
    for c in range(args.calls):
        for name, fn in ((mine, lambda w=stored[c % args.copies]: gguf_linear(x, w, kind, args.hidden)),
                         ("int8 (q8.c)", lambda m=i8[c % args.copies]: m(x))):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu_s[name].append(time.thread_time() - c0)
            times[name].append(time.perf_counter() - t0)
    loads.append(uptime())
    nbytes = {mine: stored[0].numel(), "int8 (q8.c)": i8[0].nbytes}
    med = {k: statistics.median(v) for k, v in cpu_s.items()}
    wall = {k: statistics.median(v) for k, v in times.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    flags = sorted({f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
                    for f in ln.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx"))})
    res = {"type": kind, "vocab": args.vocab, "hidden": args.hidden, "threads": args.threads, "calls": args.calls,
           "cpu": cpu, "cpu_flags": flags, "uptime": loads, "int8_build_cpu_s": build_s,
           "bytes": nbytes, "median_cpu_ms": {k: v * 1e3 for k, v in med.items()},
           "median_wall_ms": {k: v * 1e3 for k, v in wall.items()}}
    lines = [f"lm_head {args.vocab} x {args.hidden}, one token, {args.threads} thread(s), median of {args.calls} "
             f"alternating calls over {args.copies} copies. CPU: {cpu}, flags: {' '.join(flags)}", "",
             *[f"uptime: `{u}`  " for u in loads], "",
             f"Load: the int8 head built from the {kind} blocks (dequantize + quantize_rows_int8) took "
             f"{statistics.median(build_s) * 1e3:.0f} ms of CPU (median of {len(build_s)}); the {kind} head takes the "
             "blocks as read (no pass over them).", "",
             "| head | MB read | median CPU ms | GB/s by CPU time | median wall ms |", "|---|---|---|---|---|"]
    for k in times:
        lines.append(f"| {k} | {nbytes[k] / 1e6:.1f} | {med[k] * 1e3:.2f} | {nbytes[k] / med[k] / 1e9:.1f} | "
                     f"{wall[k] * 1e3:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
