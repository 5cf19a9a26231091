"""A GGUF's ``device="cpu"`` load time under two (or more) source trees, alternating rep by rep: each load in a fresh
process (``PYTHONPATH=<tree>``), wall time and process CPU time of ``MoEModel.from_pretrained`` and the process's
peak resident memory after it, medians over reps, with ``uptime`` and the CPU named.

    python -m benchmarks.peers.gguf_load_time --gguf /tmp/s16_gpt_oss/gpt-oss-mxfp4-synth-L2-E8.gguf --reps 5 \\
        --trees before=/work/wt/storedlin-before --trees after=. --out benchmarks/results/peers/s18/stored_load_gptoss

One unmeasured load per tree first (the page cache and moeflow's form cache warm for every tree alike).
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

HERE = Path(__file__).resolve()
WORKER = """
import json, resource, sys, time
import torch
from moeflow import MoEModel
from moeflow.kernels.cpu.gguf import GGUFLinear
torch.set_num_threads(int(sys.argv[2]))
t0, c0 = time.perf_counter(), time.process_time()
m = MoEModel.from_pretrained(sys.argv[1], device="cpu", progress=False)
t1, c1 = time.perf_counter(), time.process_time()
h = m.model.lm_head
head = type(h).__name__ + (" " + h.type.name if isinstance(h, GGUFLinear) else "")
print(json.dumps({"wall_s": t1 - t0, "cpu_s": c1 - c0, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                  / 1024, "lm_head": head}))
m.close()
"""


def load(tree: str, gguf: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": str(threads)}
    # (run in the tree: ``python -c`` puts the working directory ahead of PYTHONPATH)
    out = subprocess.run([sys.executable, "-c", WORKER, str(gguf.resolve()), str(threads)], env=env,
                         cwd=Path(tree).resolve(), capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--trees", action="append", default=[], help="label=path (repeatable)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = dict(t.rsplit("=", 1) for t in args.trees) or {"this tree": str(HERE.parents[2])}
    loads = [uptime()]
    for tree in trees.values():
        load(tree, args.gguf, args.threads)  # warm-up
    samples: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.reps):
        for label, tree in trees.items():
            samples[label].append(load(tree, args.gguf, args.threads))
        loads.append(uptime())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    flags = sorted({f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
                    for f in ln.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx"))})
    keys = ("wall_s", "cpu_s", "maxrss_mb")
    med = {label: {k: statistics.median(s[k] for s in samples[label]) for k in keys} for label in trees}
    res = {"gguf": str(args.gguf), "threads": args.threads, "reps": args.reps, "cpu": cpu, "cpu_flags": flags,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "uptime": loads, "trees": trees,
           "samples": samples, "median": med}
    lines = [f"`device=\"cpu\"` load of `{args.gguf.name}`, {args.threads} thread(s), fresh process per load, "
             f"alternating, median of {args.reps} reps, {res['date']}.", "",
             f"CPU: {cpu} ({os.cpu_count()} cores seen), flags: {' '.join(flags)}  ",
             *[f"uptime: `{u}`  " for u in (loads[0], loads[len(loads) // 2], loads[-1])], "",
             "| tree | lm_head | load wall s | load CPU s | peak RSS MB |", "|---|---|---|---|---|"]
    for label in trees:
        m = med[label]
        lines.append(f"| {label} | {samples[label][0]['lm_head']} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | "
                     f"{m['maxrss_mb']:.0f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
