"""How much of a decoded token's wall time is spent outside the one native step call (issue 42): the Python between
tokens (the generate loop, embedding, rotary, mask, the call's checks, argmax, stats) that a native multi-token loop
would remove. Batch 1, greedy, ``device="cpu"``; the step call (``cpu_layers.layers_step``) is wrapped with a
``perf_counter`` pair (~1 us), so "outside" = TPOT - mean wall time per step call.

    python -m benchmarks.peers.decode_glue_share --model /tmp/peers/awq-qa --threads 1 2 --lm-head-bits 8 4 \\
        --out benchmarks/results/peers/s18/glue_share
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report


def measure(model: Path, threads: int, lm_head_bits: int, tokens: int, reps: int) -> dict:
    """TPOT, the step call's mean wall time and their difference (ms), median of ``reps`` generations."""
    from moeflow import MoEModel
    from moeflow.engine import cpu_layers
    from moeflow.kernels.cpu import hugepages

    torch.set_num_threads(threads)
    # the per-token path (its step call timed); engine/native_decode.py's chunks: benchmarks/peers/native_loop_ab.py
    os.environ["MOEFLOW_NATIVE_LOOP"] = "0"
    m = MoEModel.from_pretrained(model, device="cpu", lm_head_bits=lm_head_bits, progress=False)
    hugepages.wait_collapsed(120)
    inner, spent = cpu_layers.layers_step, [0.0, 0]

    def timed(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    cpu_layers.layers_step = timed
    try:
        ids = torch.randint(3, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        kw = dict(do_sample=False, eos_token_id=[])
        rows = []
        with torch.inference_mode():
            m.generate(ids, max_new_tokens=tokens + 1, **kw)  # warm-up
            for _ in range(reps):
                spent[:] = [0.0, 0]
                m.generate(ids, max_new_tokens=tokens + 1, **kw)
                if spent[1] == 0:
                    raise SystemExit(f"{model}: the decode step never took the one native call (layers_step)")
                tpot, step = m.stats.tpot_s * 1e3, spent[0] / spent[1] * 1e3
                rows.append((tpot, step))
    finally:
        cpu_layers.layers_step = inner
        m.close()
    tpot = statistics.median(r[0] for r in rows)
    step = statistics.median(r[1] for r in rows)
    return {"threads": threads, "lm_head_bits": lm_head_bits, "tpot_ms": tpot, "step_call_ms": step,
            "outside_ms": tpot - step, "outside_share": (tpot - step) / tpot, "reps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lm-head-bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    before = uptime()
    results = []
    for t in args.threads:
        os.environ["OMP_NUM_THREADS"] = str(t)  # (the native library's team, as cpu_side_by_side's workers)
        for b in args.lm_head_bits:  # (each in a fresh process: an earlier model's memory would be beside it)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                results.append(pool.submit(measure, args.model, t, b, args.tokens, args.reps).result())
    lines = [f"Wall time per decoded token outside the one native step call, `{args.model}`, batch 1, greedy, "
             f"{args.tokens} tokens after a 16-token prompt, median of {args.reps}. CPU: {cpu}.  ",
             f"uptime before: `{before}`, after: `{uptime()}`", "",
             "| threads | lm_head_bits | TPOT ms | step call ms | outside ms | outside share |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['lm_head_bits']} | {r['tpot_ms']:.3f} | {r['step_call_ms']:.3f} | "
              f"{r['outside_ms']:.3f} | {r['outside_share']:.1%} |" for r in results]
    write_report(args.out, {"model": str(args.model), "cpu": cpu, "results": results}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
