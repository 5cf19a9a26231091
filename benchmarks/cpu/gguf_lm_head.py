"""A Q6_K ``lm_head`` on the file's blocks (``kernels/cpu/gguf.c``) against moeflow's int8 head of the same
matrix (``quantize_rows_int8``, q8.c), one token, from memory: the bytes and time of one decode step's largest read.

    python -m benchmarks cpu.gguf_lm_head --out benchmarks/results/peers/s16/lm_head_q6k

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
from moeflow.kernels.experts.gguf_reference import dequantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q6 = [blocks("Q6_K", args.vocab, args.hidden, gen) for _ in range(args.copies)]
    i8 = [quantize_rows_int8(dequantize(w, "Q6_K").reshape(args.vocab, args.hidden)) for w in q6]
    x = torch.randn(1, args.hidden, generator=gen)
    loads = [uptime()]
    times: dict[str, list[float]] = {"Q6_K (file blocks, gguf.c)": [], "int8 (q8.c)": []}
    cpu_s: dict[str, list[float]] = {k: [] for k in times}
    for c in range(args.calls):
        for name, fn in (("Q6_K (file blocks, gguf.c)", lambda w=q6[c % args.copies]: gguf_linear(x, w, "Q6_K",
                                                                                               args.hidden)),
                         ("int8 (q8.c)", lambda m=i8[c % args.copies]: m(x))):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu_s[name].append(time.thread_time() - c0)
            times[name].append(time.perf_counter() - t0)
    loads.append(uptime())
    nbytes = {"Q6_K (file blocks, gguf.c)": q6[0].numel(), "int8 (q8.c)": i8[0].nbytes}
    med = {k: statistics.median(v) for k, v in cpu_s.items()}
    wall = {k: statistics.median(v) for k, v in times.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    res = {"vocab": args.vocab, "hidden": args.hidden, "threads": args.threads, "calls": args.calls, "cpu": cpu,
           "uptime": loads, "bytes": nbytes, "median_cpu_ms": {k: v * 1e3 for k, v in med.items()},
           "median_wall_ms": {k: v * 1e3 for k, v in wall.items()}}
    lines = [f"lm_head {args.vocab} x {args.hidden}, one token, {args.threads} thread(s), median of {args.calls} "
             f"alternating calls over {args.copies} copies. CPU: {cpu}", "",
             *[f"uptime: `{u}`  " for u in loads], "",
             "| head | MB read | median CPU ms | GB/s by CPU time | median wall ms |", "|---|---|---|---|---|"]
    for k in times:
        lines.append(f"| {k} | {nbytes[k] / 1e6:.1f} | {med[k] * 1e3:.2f} | {nbytes[k] / med[k] / 1e9:.1f} | "
                     f"{wall[k] * 1e3:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
