"""``moeflow demo --device cpu`` and the embedded model's resident CPU decode, two source trees A/B (issue 21).

Runs each tree's demo (TTFT, decode tok/s as the demo prints them) and a resident greedy generate on the
embedded model (default kernels, eager and, with ``--compile``, ``compile_decode``), alternating A and B
``--reps`` times so the machine's load hits both alike; reports medians with ``uptime`` before and after.
With ``--peers-work`` (``run_peers.py``'s scratch directory) each run also decodes the peer benchmark's
synthetic Mixtral (``run_peers.moeflow_cpu``: tg tok/s by wall time and CPU ms per token on one thread) with
``--attention-bits`` (default 8: every attention projection and the lm_head through the int8 kernel).

    python -m benchmarks.peers.cpu_demo_ab --a /tmp/before --b . --reps 5 --out benchmarks/results/peers/demo_ab
    python -m benchmarks.peers.cpu_demo_ab --a /tmp/q8_base --b . --reps 3 --peers-work /tmp/peers \
        --out benchmarks/results/cpu_native/s5_q8_e2e
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.peers.peer_report import uptime, write_report

REPO = Path(__file__).resolve().parents[2]

DEMO = "import sys; from moeflow.cli import main; sys.exit(main(['demo', '--device', 'cpu']))"
RESIDENT = """
import json, sys, time, torch
from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
m = MoEOffloadedMixtral.from_pretrained(embedded_model_path())
ids = torch.tensor([m.tokenizer.encode("The import statement")])
out = {"kernels": m.kernels}
for mode in sys.argv[1:]:
    if mode == "compile":
        t0 = time.perf_counter(); m.compile_decode()
        m.generate(ids, max_new_tokens=4, do_sample=False)
        out["compile_s"] = time.perf_counter() - t0
    m.generate(ids, max_new_tokens=4, do_sample=False)
    m.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=[])
    out[mode] = {"ttft_ms": m.stats.ttft_s * 1e3, "tok_s": 1 / m.stats.tpot_s}
print("RESULT " + json.dumps(out))
"""


def run(tree: Path, code: str, *args: str) -> str:
    # moeflow from ``tree``; ``benchmarks`` from ``tree`` when it is a package there, else from this checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree.resolve()), str(REPO)]))
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900)
    if res.returncode:
        raise RuntimeError(f"{tree}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return res.stdout


def demo(tree: Path) -> dict:
    out = run(tree, DEMO)
    m = re.search(r"TTFT ([\d.]+) ms \| decode ([\d.]+) tok/s", out)
    return {"ttft_ms": float(m.group(1)), "tok_s": float(m.group(2))}


def resident(tree: Path, modes: list[str]) -> dict:
    line = next(ln for ln in run(tree, RESIDENT, *modes).splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def peers(tree: Path, work: Path, attention_bits: int, tg: int) -> dict:
    """run_peers.moeflow_cpu on the synthetic Mixtral with ``tree``'s moeflow (prompt 32, 3 reps, CPU time)."""
    code = ("import json, torch; "
            "from pathlib import Path; from benchmarks.peers.run_peers import moeflow_cpu; "
            f"print('RESULT ' + json.dumps(moeflow_cpu(Path({str(work / 'awq')!r}), [32], {tg}, 3, 120.0, "
            f"{attention_bits}, True)))")
    line = next(ln for ln in run(tree, code).splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def median_of(rows: list[dict], *path: str) -> float:
    vals = []
    for r in rows:
        for p in path:
            r = r.get(p) if isinstance(r, dict) else None
        if r is not None:
            vals.append(r)
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="source tree A (before)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B (after)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time compile_decode (B only)")
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--peers-work", type=Path, default=None, help="run_peers.py's scratch directory (awq/)")
    ap.add_argument("--attention-bits", type=int, default=8)
    ap.add_argument("--tg", type=int, default=32, help="decoded tokens per peers repetition")
    args = ap.parse_args()
    result = {"uptime_before": uptime(), "a": str(args.a), "b": str(args.b), "runs": {"a": [], "b": []}}
    for rep in range(args.reps):
        for side in ("a", "b"):
            tree = args.a if side == "a" else args.b
            modes = ["eager", "compile"] if args.compile and side == "b" and rep == 0 else ["eager"]
            row = {"demo": demo(tree), "resident": resident(tree, modes), "uptime": uptime()}
            if args.peers_work:
                row["peers"] = peers(tree, args.peers_work, args.attention_bits, args.tg)
                row["uptime_after_peers"] = uptime()
            result["runs"][side].append(row)
            print(side, rep, json.dumps(row), flush=True)
    result["uptime_after"] = uptime()
    lines = [f"uptime before: `{result['uptime_before']}`  ", f"uptime after: `{result['uptime_after']}`", "",
             f"Medians of {args.reps} alternating runs. A = `{args.a}`, B = `{args.b}`.", "",
             "| run | A | B | B / A |", "|---|---|---|---|"]
    rows = [("demo TTFT ms", ("demo", "ttft_ms"), "lower"),
            ("demo decode tok/s", ("demo", "tok_s"), "higher"),
            ("resident TTFT ms", ("resident", "eager", "ttft_ms"), "lower"),
            ("resident decode tok/s", ("resident", "eager", "tok_s"), "higher")]
    if args.peers_work:
        bits = args.attention_bits
        rows += [(f"peers attention_bits={bits} tg{args.tg} tok/s (wall)", ("peers", "tg"), "higher"),
                 (f"peers attention_bits={bits} decode CPU ms / token (1 thread)", ("peers", "decode_cpu_ms_1thread"),
                  "lower"),
                 (f"peers attention_bits={bits} pp32 tok/s (wall)", ("peers", "pp32"), "higher")]
    for label, path, better in rows:
        a, b = median_of(result["runs"]["a"], *path), median_of(result["runs"]["b"], *path)
        speedup = a / b if better == "lower" else b / a
        result.setdefault("medians", {})[label] = {"a": a, "b": b, "speedup": speedup}
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {speedup:.2f}x faster |")
    write_report(args.out, result, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
