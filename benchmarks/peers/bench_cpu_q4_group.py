"""moeflow's CPU q4 expert kernel (``q4_expert``: w13 then w2, one SwiGLU expert) at group 32 (a GGUF Q4_0 file's
experts: fp16 scale per 32 inputs, zero point 8) against group 128 (AWQ's), on the peer benchmark's expert shape
(hidden 1024, intermediate 3584), decode (T = 1) and a short prompt (T = 16), 1 and 2 threads (issue 42).

Enough experts are cycled through (>= 200 MB) that the weights stream from memory, as in a decode step. Figures:
CPU time per expert (process time, all threads: what a shared machine's load moves least; the median and the
best of ``--reps`` passes), the weight bytes read per CPU second, and each form's time over group 128's. Each
``--tree`` (``label=path``) runs in its own process (``PYTHONPATH=path``), rounds alternating the trees, so a
loaded machine's load hits them alike.

    python -m benchmarks.peers.bench_cpu_q4_group --tree base=/work/main --tree new=. --rounds 2 \\
        --out benchmarks/results/peers/s15/q4_group
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

H, INTER = 1024, 3584
MIN_BYTES = 200_000_000


def worker(groups: list[str], tokens: list[int], threads: list[int], reps: int, min_bytes: int) -> list[dict]:
    """Runs inside the tree under test (imports its moeflow)."""
    import torch

    from moeflow.kernels.cpu import native
    from moeflow.kernels.cpu.q4_matrix import Q4Matrix, group_rows, q4_expert

    assert native.native_available(), "moeflow's CPU kernels did not build"
    gen = torch.Generator().manual_seed(0)

    def matrix(n: int, k: int, form: str) -> Q4Matrix:
        group = int(form.removesuffix("z8"))
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        s = (torch.rand(n, k // group, generator=gen) * 1e-2).half()
        z = torch.full((n, k // group), 8, dtype=torch.uint8) if group == 32 else \
            torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=gen)
        if form.endswith("z8"):  # GGUF Q4_0's form: no zero points stored (trees that have it)
            return Q4Matrix(packed, group_rows(s), torch.empty(0, dtype=torch.uint8), group)
        return Q4Matrix(packed, group_rows(s), group_rows(z), group)

    rows = []
    with torch.inference_mode():
        for group in groups:
            if group.endswith("z8") and not hasattr(native, "Q4_F16Z8"):
                continue
            first = (matrix(2 * INTER, H, group), matrix(H, INTER, group))
            nbytes = first[0].nbytes + first[1].nbytes
            experts = [first] + [(matrix(2 * INTER, H, group), matrix(H, INTER, group))
                                 for _ in range(max(1, -(-min_bytes // nbytes)) - 1)]
            for th in threads:
                torch.set_num_threads(th)
                for t in tokens:
                    x = torch.randn(t, H, generator=gen)
                    w = torch.ones(t)
                    q4_expert(x, *experts[0], w)
                    wall = []  # CPU time (all threads): what a shared machine's load moves least
                    for _ in range(reps):
                        t0 = time.process_time()
                        for e in experts:
                            q4_expert(x, *e, w)
                        wall.append((time.process_time() - t0) / len(experts))
                    rows.append({"group": group, "threads": th, "tokens": t, "expert_mb": round(nbytes / 1e6, 3),
                                 "us_median": round(statistics.median(wall) * 1e6, 1),
                                 "us_best": round(min(wall) * 1e6, 1),
                                 "gbps_best": round(nbytes / min(wall) / 1e9, 2)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del experts, first
    return rows


def run_tree(path: Path, args: argparse.Namespace) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path.resolve()), str(Path(__file__).resolve().parents[2])]))
    cmd = [sys.executable, __file__, "--worker", "--groups", args.groups, "--tokens", args.tokens,
           "--threads", args.threads, "--reps", str(args.reps), "--min-mb", str(args.min_mb)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{path}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def summary(trees: list[str], rounds: list[dict]) -> list[str]:
    lines = ["| tree | form | threads | T | CPU us/expert (best) | GB per CPU s (best) | time / g128's |",
             "|---|---|---|---|---|---|---|"]
    for tree in trees:
        rows = [r for rd in rounds for r in rd[tree]]
        for th, t in sorted({(r["threads"], r["tokens"]) for r in rows}):
            best = {}
            for r in rows:
                if (r["threads"], r["tokens"]) == (th, t):
                    best[r["group"]] = min(best.get(r["group"], r), r, key=lambda v: v["us_best"])
            for g, r in best.items():
                ratio = r["us_best"] / best["128"]["us_best"] if "128" in best else float("nan")
                lines.append(f"| {tree} | g{g} | {th} | {t} | {r['us_best']:.0f} | {r['gbps_best']:.2f} | "
                             f"{ratio:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="label=path (repeatable); default: this tree")
    ap.add_argument("--groups", default="128,32,32z8", help="128, 32 (zero points stored), 32z8 (GGUF Q4_0's form)")
    ap.add_argument("--min-mb", type=int, default=MIN_BYTES // 10**6,
                    help="experts cycled (MB): >= 200 streams from memory; 0: one expert, from cache")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
        print(json.dumps(worker(args.groups.split(","), ints(args.tokens), ints(args.threads), args.reps,
                                args.min_mb * 10**6)))
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": "."}
    marks, rounds = [uptime()], []
    for r in range(args.rounds):
        rounds.append({})
        for label, path in trees.items():
            rounds[-1][label] = run_tree(Path(path), args)
            marks.append(f"round {r} {label}: {uptime()}")
            print(marks[-1], flush=True)
    cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni") if f in flags.split())
    lines = [f"CPU q4 expert kernel, group 32 vs 128 (H {H}, I {INTER}), trees {trees}, {args.rounds} round(s), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", f"CPU: {cpu.split(':', 1)[-1].strip()} "
             f"({isa})", "", *[f"* `{m}`" for m in marks], "", *summary(list(trees), rounds)]
    print("\n".join(lines))
    if args.out:
        write_report(args.out, {"trees": trees, "args": vars(args) | {"out": str(args.out)}, "uptime": marks,
                                "rounds": rounds}, lines)


if __name__ == "__main__":
    main()
