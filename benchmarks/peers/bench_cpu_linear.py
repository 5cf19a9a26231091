"""moeflow's CPU int8 and int4 linear kernels at lm_head and attention shapes, beside this core's copy and
streaming-read bandwidth, for one or more source trees measured alternately in one run (issue 21).

Shapes (N x K): lm_head 32000 x 4096 and 151936 x 4096, attention 4096 x 4096 and 1024 x 4096 (k/v of a GQA
model). Each layer is a :class:`~moeflow.kernels.cpu.quant_linear.CpuQuantLinear` built from random codes (int8
per row; int4 g128), called on T tokens; small matrices are cycled through enough copies (>= 200 MB) that
the weights stream from memory as in a decode step. Figures: weight bytes read per second (wall, and per CPU
second: all threads' CPU time, what a shared machine's load moves least; and per the fastest of ``--reps``
passes, the one the other processes disturbed least), and per-byte slowdown vs T = 1.
Bandwidth in the same worker: ``torch`` copy of 256 MB (bytes copied per second, one thread) and the streaming
read of ``cpu_roofline.c`` (the read-only peak).

Each ``--tree`` (``label=path``) runs in its own worker process (``PYTHONPATH=path``); rounds alternate the
trees so the machine's load hits them alike; the summary gives medians per tree and each tree's ratio to the
first one, round by round.

    python -m benchmarks.peers.bench_cpu_linear --tree base=/tmp/q8_base --tree new=. --rounds 3 \\
        --out benchmarks/results/cpu_native/s5_q8_kernel
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.peer_report import uptime, write_report

SHAPES = {"lm_head_32000": (32000, 4096), "lm_head_151936": (151936, 4096), "attn_4096": (4096, 4096),
          "attn_kv_1024": (1024, 4096)}
GROUP = 128
MIN_BYTES = 200_000_000


def worker(shapes: list[str], tokens: list[int], threads: list[int], bits: list[int], reps: int) -> dict:
    """Runs inside the tree under test (imports its moeflow)."""
    import torch

    from benchmarks.peers.cpu_roofline import measure
    from moeflow.kernels.cpu.native import native_available
    from moeflow.kernels.cpu.q4_matrix import Q4Matrix
    from moeflow.kernels.cpu.quant_linear import CpuQuantLinear

    assert native_available(), "moeflow's CPU kernels did not build"
    gen = torch.Generator().manual_seed(0)

    def layer(b: int, n: int, k: int) -> CpuQuantLinear:
        if b == 8:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            return CpuQuantLinear(8, k, n, int8_weight=q, int8_scales=torch.rand(n, generator=gen) * 1e-2)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        s, m = torch.rand(n, k // GROUP, generator=gen) * 1e-2, -torch.rand(n, k // GROUP, generator=gen) * 1e-2
        return CpuQuantLinear(4, k, n, int4=Q4Matrix(packed, s, m, GROUP))

    torch.set_num_threads(1)
    src, dst = torch.ones(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)
    copy = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t0)
    del src, dst
    bandwidth = {"torch_copy_gbps_1_thread": round((256 << 20) / min(copy) / 1e9, 2),
                 "stream_read_gbps_1_thread": measure(1)[0]["stream_read_gbps_1_thread"]}
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            n, k = SHAPES[shape]
            for b in bits:
                first = layer(b, n, k)
                layers = [first] + [layer(b, n, k) for _ in range(max(1, -(-MIN_BYTES // first.nbytes)) - 1)]
                nbytes = first.nbytes
                for th in threads:
                    torch.set_num_threads(th)
                    base = None
                    for t in tokens:
                        x = torch.randn(t, k, generator=gen)
                        layers[0](x)
                        cpu, wall = [], []
                        for _ in range(reps):
                            c0, w0 = time.process_time(), time.perf_counter()
                            for lay in layers:
                                lay(x)
                            cpu.append((time.process_time() - c0) / len(layers))
                            wall.append((time.perf_counter() - w0) / len(layers))
                        c, w = statistics.median(cpu), statistics.median(wall)
                        base = base or (w, c)
                        rows.append({"shape": shape, "n": n, "k": k, "bits": b, "threads": th, "tokens": t,
                                     "weight_mb": round(nbytes / 1e6, 2), "wall_ms": round(w * 1e3, 3),
                                     "cpu_ms": round(c * 1e3, 3), "gbps_wall": round(nbytes / w / 1e9, 2),
                                     "gbps_cpu": round(nbytes / c / 1e9, 2),
                                     "gbps_best_wall": round(nbytes / min(wall) / 1e9, 2),
                                     "slowdown_per_byte_wall": round(w / base[0], 2),
                                     "slowdown_per_byte_cpu": round(c / base[1], 2)})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                del layers, first
    return {"bandwidth": bandwidth, "rows": rows}


def run_tree(path: Path, args: argparse.Namespace) -> dict:
    # moeflow from ``path``; ``benchmarks`` (peer_report) from this checkout unless ``path`` has it as a package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path.resolve()), str(Path(__file__).resolve().parents[2])]))
    cmd = [sys.executable, __file__, "--worker", "--shapes", args.shapes, "--tokens", args.tokens,
           "--threads", args.threads, "--bits", args.bits, "--reps", str(args.reps)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{path}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def summary(trees: list[str], rounds: list[dict]) -> list[str]:
    """Markdown: per shape/bits/threads/T, each tree's GB/s (the best pass of all rounds by wall time, and the
    median over rounds of the CPU-time figure) and its ratio to the first tree's best pass of the same round
    (median over rounds)."""
    key = ("shape", "bits", "threads", "tokens")
    lines = ["| shape | bits | threads | T | " + " | ".join(f"{t} GB/s best wall (median cpu)" for t in trees) +
             "".join(f" | {t} / {trees[0]} (best wall)" for t in trees[1:]) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(trees) - 1)]
    first = rounds[0][trees[0]]["rows"]
    for row in first:
        k = tuple(row[f] for f in key)
        per = {t: [next(r for r in rd[t]["rows"] if tuple(r[f] for f in key) == k) for rd in rounds] for t in trees}
        cells = [f"{max(r['gbps_best_wall'] for r in per[t]):.2f} "
                 f"({statistics.median(r['gbps_cpu'] for r in per[t]):.2f})" for t in trees]
        ratios = [statistics.median(a["gbps_best_wall"] / b["gbps_best_wall"]
                                    for a, b in zip(per[t], per[trees[0]], strict=True)) for t in trees[1:]]
        ratios = [f"{v:.2f}x" for v in ratios]
        lines.append("| " + " | ".join(map(str, k)) + " | " + " | ".join(cells + ratios) + " |")
    bw = {t: {f: statistics.median(rd[t]["bandwidth"][f] for rd in rounds) for f in rounds[0][t]["bandwidth"]}
          for t in trees}
    lines += ["", "Bandwidth in each worker (median over rounds, GB/s): " +
              "; ".join(f"{t}: " + ", ".join(f"{f} {v:.2f}" for f, v in b.items()) for t, b in bw.items())]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="label=path (repeatable); default: this tree")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
        print(json.dumps(worker(args.shapes.split(","), ints(args.tokens), ints(args.threads), ints(args.bits),
                                args.reps)))
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": "."}
    marks, rounds = [uptime()], []
    for r in range(args.rounds):
        rounds.append({})
        for label, path in trees.items():
            rounds[-1][label] = run_tree(Path(path), args)
            marks.append(f"round {r} {label}: {uptime()}")
            print(marks[-1], flush=True)
    lines = [f"CPU linear kernels, trees {trees}, {args.rounds} round(s), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", *[f"* `{m}`" for m in marks], "",
             *summary(list(trees), rounds)]
    print("\n".join(lines))
    if args.out:
        meta = vars(args) | {"out": str(args.out)}
        write_report(args.out, {"trees": trees, "args": meta, "uptime": marks, "rounds": rounds}, lines)


if __name__ == "__main__":
    main()
