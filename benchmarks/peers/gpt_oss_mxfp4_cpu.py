"""moeflow ``device="cpu"`` beside llama.cpp's CPU build on one synthetic gpt-oss MXFP4 GGUF: decode tok/s and CPU
ms per decoded token, alternating rep by rep (the shared machine's load hits both alike).

The file: a random transformers gpt-oss at gpt-oss-120b's expert shapes (H = I = 2880) with few layers and experts
(``--layers``, ``--experts``, top-4 as gpt-oss) and a small attention (8 heads of 64, 2 KV heads; vocab 97), written
by the tests' GGUF writer (``tests/gguf_gpt_oss.py``: llama.cpp's converter's layout, experts MXFP4 by gguf-py's
quantizer, attention Q8_0). moeflow computes the experts with its native MXFP4 kernel on the stored blocks
(``MXFP4Format.cpu_kernels``; since s17 every layer of a decode step in one native call, step_gptoss.c) and
the attention projections on the file's Q8_0 blocks (``attention_bits="auto"``; fp32 before s16-gptosscpu); llama.cpp
runs ``llama-bench -p 0 -n tg``. ``--before TREE``: a second moeflow tree (a worktree of the base branch) alternated
with this one, each in its own worker process.

    python -m benchmarks.peers.gpt_oss_mxfp4_cpu --work /tmp/s16_gpt_oss --threads 1 --reps 3 \\
        --out benchmarks/results/peers/s16/gpt_oss_mxfp4_t1
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

from benchmarks.peers.cpu_side_by_side import llama_rep
from benchmarks.peers.peer_report import uptime, write_report

ROOT = Path(__file__).resolve().parents[2]


def make_gguf(path: Path, layers: int, experts: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_gpt_oss import write_gpt_oss_gguf
    from gpt_oss_helpers import make_gpt_oss_model

    model = make_gpt_oss_model(seed=0, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                               num_local_experts=experts, num_experts_per_tok=4, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64, sliding_window=128, max_position_embeddings=4096)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gpt_oss_gguf(model, path)


def worker(path: Path, threads: int, tg: int) -> None:
    """Load the model, then answer every line on stdin with one measurement (a JSON line)."""
    import torch

    from moeflow import MoEModel
    from moeflow.kernels.cpu.native import SIMD_NAMES, library

    torch.set_num_threads(threads)
    m = MoEModel.from_pretrained(path, device="cpu", progress=False)
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=False, eos_token_id=[])
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=tg + 1, **kw)  # warm-up
        print(json.dumps({"ready": True, "cpu_kernels": bool(m.experts.fmt.cpu_kernels),
                          "simd": SIMD_NAMES[library().mf_simd()]}), flush=True)
        for _ in sys.stdin:
            c0 = time.process_time()
            m.generate(ids, max_new_tokens=1, **kw)
            c1 = time.process_time()
            m.generate(ids, max_new_tokens=tg + 1, **kw)
            c2 = time.process_time()
            print(json.dumps({"decode_tok_s": 1 / m.stats.tpot_s, "cpu_ms": ((c2 - c1) - (c1 - c0)) / tg * 1e3}),
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--llama-bin", type=Path, default=Path("/tmp/peers/llama.cpp/build/bin"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--before", type=Path, help="a second moeflow tree (e.g. a worktree of the base branch), run as "
                    "'moeflow (before)' alternated with this one and llama.cpp")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.tg)
        return
    path = args.work / f"gpt-oss-mxfp4-synth-L{args.layers}-E{args.experts}.gguf"
    if not path.is_file():
        make_gguf(path, args.layers, args.experts)
    cpu = open("/proc/cpuinfo").read()
    name = next(ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("model name"))
    flags = " ".join(sorted({w for w in cpu.split() if w.startswith("avx512")}))
    loads = [uptime()]
    trees = [("moeflow", ROOT)] + ([("moeflow (before)", args.before.resolve())] if args.before else [])
    procs, infos, rows = {}, {}, {who: [] for who, _ in trees}
    for who, tree in trees:  # each tree's worker imports that tree's moeflow
        procs[who] = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers.gpt_oss_mxfp4_cpu", "--worker", str(path), "--threads",
             str(args.threads), "--tg", str(args.tg), "--work", str(args.work)], cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        infos[who] = json.loads(procs[who].stdout.readline())
    info = infos["moeflow"]
    theirs = []
    for _ in range(args.reps):
        for who, p in procs.items():
            p.stdin.write("\n")
            p.stdin.flush()
            rows[who].append(json.loads(p.stdout.readline()))
        theirs.append(llama_rep(args.llama_bin / "llama-bench", path, args.threads, args.tg))
        loads.append(uptime())
    for p in procs.values():
        p.stdin.close()
        p.wait()
    med = {who: {k: statistics.median(r[k] for r in reps) for k in ("decode_tok_s", "cpu_ms")}
           for who, reps in (*rows.items(), ("llama.cpp", theirs))}
    result = {"gguf": path.name, "bytes": path.stat().st_size, "threads": args.threads, "tg": args.tg,
              **{who: {"info": infos[who], "reps": r} for who, r in rows.items()}, "llama.cpp": {"reps": theirs},
              "median": med,
              "cpu": name, "avx512": flags, "uptime": loads}
    lines = [f"# gpt-oss MXFP4 on the CPU: moeflow device=\"cpu\" vs llama.cpp ({args.threads} thread(s))\n",
             f"`{' '.join(sys.argv)}`\n", f"CPU: {name}; {flags}\n", "uptime: " + " | ".join(loads) + "\n",
             f"File: {path.name} ({path.stat().st_size / 1e6:.0f} MB; {args.layers} layers x {args.experts} experts, "
             f"top-4, H = I = 2880, experts MXFP4, attention Q8_0); decode of {args.tg} tokens after 16; "
             f"{args.reps} reps alternated, medians. llama.cpp build {theirs[0].get('build')}; moeflow "
             f"{info['simd']}, native MXFP4 experts: {info['cpu_kernels']}.\n",
             "| engine | decode tok/s | CPU ms / decoded token |", "|---|---|---|"]
    lines += [f"| {who} | {v['decode_tok_s']:.2f} | {v['cpu_ms']:.1f} |" for who, v in med.items()]
    ratio = med["moeflow"]["decode_tok_s"] / med["llama.cpp"]["decode_tok_s"]
    lines.append(f"\nmoeflow / llama.cpp decode: {ratio:.2f}x")
    if args.before:
        lines.append(f"moeflow / moeflow (before, {args.before}) decode: "
                     f"{med['moeflow']['decode_tok_s'] / med['moeflow (before)']['decode_tok_s']:.2f}x; before / "
                     f"llama.cpp: {med['moeflow (before)']['decode_tok_s'] / med['llama.cpp']['decode_tok_s']:.2f}x")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, result, lines)


if __name__ == "__main__":
    main()
