"""GGUF load time (issues 37, 39): ``from_pretrained`` of a Q4_0 GGUF against the AWQ checkpoint of the same
weights, each in a cold process, CPU seconds (user + system, every thread) and wall; optionally the same for an
older moeflow tree (``--before DIR``: its ``PYTHONPATH``) so a change is measured before and after in one run.

The files are the GPU lane's (``benchmarks/common/checkpoint.py``'s AWQ writer and ``common/gguf_checkpoint.py``'s
Q4_0 GGUF of the same codes and scales), written when missing: ``--layers`` of Mixtral-8x7B's 32 (2: 2.0 GB of
AWQ, 2.16 GB of GGUF). Loads: ``device="cpu"`` (the CPU int4 expert form) and ``kernels="torch"`` (the AWQ slot
pool of the Triton/torch path), both ``OffloadConfig(policy="lru", gpu_expert_slots=4)``, best of ``--repeat``
by CPU seconds. Also one expert's Q4_0 -> AWQ conversion per core (thread CPU time): the word-moving converter
(C, and its torch twin) against the unpacking reference.

    git archive <before> | tar -x -C /tmp/moeflow-before   # the older tree, once
    python -m benchmarks.disk.gguf_load --layers 2 --before /tmp/moeflow-before \
        --out benchmarks/results/cold_start/gguf_s15
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, write_synthetic_awq_checkpoint
from benchmarks.common.gguf_checkpoint import write_synthetic_gguf
from benchmarks.disk.cold_start import cpu_name
from benchmarks.peers.peer_report import uptime, write_report

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, time
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system seconds, every thread
from moeflow import MoEModel, OffloadConfig
kw = {"device": "cpu"} if sys.argv[2] == "cpu" else {"kernels": sys.argv[2]}
c0, t0 = cpu(), time.perf_counter()
model = MoEModel.from_pretrained(sys.argv[1], progress=False, offload=OffloadConfig(policy="lru", gpu_expert_slots=4),
                                 **kw)
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.perf_counter() - t0, "kernels": model.kernels}))
"""


def cold_load(tree: Path, path: Path, mode: str, repeat: int) -> dict:
    """Best (by CPU seconds) of ``repeat`` cold processes importing moeflow from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    runs = []
    for _ in range(repeat):
        res = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, env=env,
                             cwd="/", timeout=1800)
        if res.returncode:
            raise RuntimeError(f"loading {path} ({mode}) with {tree}: {res.stderr[-2000:]}")
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["cpu_s"])
    return {**best, "runs": runs}


def conversion(gguf: Path) -> dict:
    """GB/s of Q4_0 bytes per CPU-second (this thread) converting one expert into the AWQ format's tensors."""
    from moeflow.engine import gguf_experts as ge
    from moeflow.io.gguf import open_gguf
    from moeflow.io.gguf.experts import q4_0_awq_expert_tensors_reference

    cfg = MIXTRAL_8X7B
    src = open_gguf(gguf).expert_source((0,), cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"])
    x = src.expert(0, 1)
    raw = {p: t.clone() for p, t in src.read_raw(0, 1, src.new_staging()).items()}
    lib = ge.library()
    out = {}
    for name, convert, use_lib, reps in (("packed words, C", ge.q4_0_awq_expert_tensors, True, 5),
                                         ("packed words, torch", ge.q4_0_awq_expert_tensors, False, 1),
                                         ("unpacking reference", q4_0_awq_expert_tensors_reference, True, 1)):
        ge.library = (lambda: lib) if use_lib else (lambda: None)
        try:
            convert(x, raw)
            t = time.thread_time()
            for _ in range(reps):
                convert(x, raw)
            dt = (time.thread_time() - t) / reps
        finally:
            ge.library = lambda: lib
        out[name] = {"ms": round(dt * 1e3, 1), "gb_per_s": round(x.nbytes / dt / 1e9, 3)}
    src.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the checkpoints are (written if missing)")
    ap.add_argument("--before", type=Path, default=None, help="an older moeflow tree to measure beside this one")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="result path without suffix (.json and .md written)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = {**MIXTRAL_8X7B, "num_hidden_layers": args.layers}
    awq = args.dir / f"moeflow-synthetic-mixtral-8x7b-awq-L{args.layers}"
    gguf = args.dir / f"moeflow-synthetic-mixtral-8x7b-awq-L{args.layers}-q4_0.gguf"
    if not (awq / "config.json").is_file():
        write_synthetic_awq_checkpoint(awq, config)
    write_synthetic_gguf(gguf, "mixtral", config)
    load_before = uptime()
    trees = {"after": ROOT} | ({"before": args.before} if args.before else {})
    loads = {}
    for tag, tree in trees.items():
        for mode in ("cpu", "torch"):
            loads[f"{tag} gguf {mode}"] = cold_load(tree, gguf, mode, args.repeat)
            print(tag, "gguf", mode, loads[f"{tag} gguf {mode}"], flush=True)
    loads["after awq cpu"] = cold_load(ROOT, awq, "cpu", args.repeat)
    conv = conversion(gguf)
    result = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "awq": str(awq), "layers": args.layers,
              "cpu": cpu_name(), "uptime_before": load_before, "uptime_after": uptime(), "trees": {
                  k: str(v) for k, v in trees.items()}, "loads": loads, "conversion_per_core": conv}
    lines = [f"# GGUF load: Mixtral-8x7B {args.layers}-layer slice, Q4_0 GGUF ({result['gguf_bytes'] / 1e9:.2f} GB) "
             "and the AWQ checkpoint of the same weights", "",
             f"CPU: {result['cpu']['model_name']} ({result['cpu']['cores']} cores, "
             f"{', '.join(result['cpu']['simd'])}); "
             f"load before: `{load_before}`, after: `{result['uptime_after']}`. Cold processes, best of "
             f"{args.repeat} by CPU seconds; `OffloadConfig(policy=\"lru\", gpu_expert_slots=4)`.", "",
             "| load | CPU s (user + system, all threads) | wall s | kernels |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['cpu_s']:.2f} | {v['wall_s']:.2f} | {v['kernels']} |" for k, v in loads.items()]
    lines += ["", "One expert's Q4_0 -> AWQ conversion (gate + up + down, one thread, thread CPU time):", ""]
    lines += [f"* {k}: {v['ms']} ms, {v['gb_per_s']} GB/s" for k, v in conv.items()]
    write_report(args.out, result, lines)


if __name__ == "__main__":
    main()
