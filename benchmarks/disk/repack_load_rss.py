"""What repacking a GGUF's Q4_K experts at load costs (issue 42, session 19; moeflow/kernels/cpu/gguf_repack.py):
``from_pretrained(path, device="cpu")`` seconds, the repack's own seconds and bytes, the first token from process
start, and the process's memory (``VmRSS``, ``RssAnon``, ``RssFile``, peak ``VmHWM`` from /proc/self/status) after
the load and after the first token, with ``MOEFLOW_GGUF_REPACK`` on and off, alternating in fresh processes.

    python -m benchmarks.disk.repack_load_rss --model /tmp/moeflow-mmap-s16-mixtral-8x7b-L2-Q4_K_M.gguf --repeats 3 \\
        --out benchmarks/results/peers/s19/repack_load_rss

(The page cache is warm: the file is read once first. The file's pages stay in the page cache either way; with the
repack the Q4_K pages read are dropped from the process's resident set and the copy is anonymous memory.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.disk.cold_start import cpu_name, read_single
from benchmarks.peers.peer_report import uptime, write_report

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import json, os, sys, time
t0 = float(os.environ["COLD_T0"])
import torch
from moeflow import MoEModel
def status():
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    return {k: round(int(v.split()[0]) / 2**20, 3) for k, v in (ln.split(":", 1) for ln in open("/proc/self/status"))
            if k in keys}
t1 = time.time()
m = MoEModel.from_pretrained(sys.argv[1], device="cpu", progress=False)
t2 = time.time()
loaded = status()
m.generate(torch.tensor([[1, 15, 27, 3]]), max_new_tokens=1, do_sample=False)
t3 = time.time()
b = m.experts
print(json.dumps({"backend": type(b).__name__, "import_s": t1 - t0, "from_pretrained_s": t2 - t1,
                  "repack_s": getattr(b, "repack_s", 0.0), "repacked_gb": getattr(b, "repacked_nbytes", 0) / 1e9,
                  "first_token_s": t3 - t0, "after_load_gb": loaded, "after_first_token_gb": status()}))
m.close()
"""


def one(model: Path, repack: str) -> dict:
    env = dict(os.environ, MOEFLOW_GGUF_REPACK=repack, COLD_T0=repr(time.time()),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    read_single([args.model])  # page cache warm
    loads = [uptime()]
    one(args.model, "1")  # (not counted: the native library's build, the tokenizer's cache)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for label, flag in (("on", "1"), ("off", "0")):
            runs[label].append(one(args.model, flag))
    loads.append(uptime())
    best = {k: min(v, key=lambda r: r["first_token_s"]) for k, v in runs.items()}
    res = {"model": str(args.model), "bytes": args.model.stat().st_size, "cpu": cpu_name(), "uptime": loads,
           "runs": runs, "best": best}
    lines = [f"Q4_K repack at load, `{args.model.name}` ({res['bytes'] / 1e9:.2f} GB), best of {args.repeats} fresh "
             f"processes by first token, page cache warm. CPU: {res['cpu']['model_name']} "
             f"({res['cpu']['cores']} cores, {', '.join(res['cpu']['simd'])}); uptime before `{loads[0]}`, after "
             f"`{loads[1]}`.", "",
             "| MOEFLOW_GGUF_REPACK | from_pretrained s | of which repack s (GB) | first token from start s | "
             "RSS after load (anon / file) GB | RSS after 1st token (anon / file) GB | peak RSS GB |",
             "|---|---|---|---|---|---|---|"]
    for label, b in best.items():
        a, f = b["after_load_gb"], b["after_first_token_gb"]
        lines.append(f"| {label} | {b['from_pretrained_s']:.2f} | {b['repack_s']:.2f} ({b['repacked_gb']:.2f}) | "
                     f"{b['first_token_s']:.2f} | {a['VmRSS']:.2f} ({a['RssAnon']:.2f} / {a['RssFile']:.2f}) | "
                     f"{f['VmRSS']:.2f} ({f['RssAnon']:.2f} / {f['RssFile']:.2f}) | {f['VmHWM']:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
