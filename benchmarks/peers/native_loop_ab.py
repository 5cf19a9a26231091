"""The native multi-token decode loop on and off (issue 42, engine/native_decode.py): decode TPOT and wall time per
decoded token, batch 1, greedy, ``device="cpu"``, with ``MOEFLOW_NATIVE_LOOP`` switched between generations of one
loaded model (on / off alternating, so the shared machine's load falls on both), medians of ``reps`` each.

``TPOT`` is ``stats.tpot_s`` (the mean of the decode steps' times generate() measures); ``wall/token`` is the
generate call's wall time minus its time to first token, over the decoded tokens after the first (it also counts
the generate loop's own per-token work outside the steps, which TPOT leaves out).

    python -m benchmarks.peers.native_loop_ab --model /tmp/peers/awq-qa --threads 1 2 \\
        --out benchmarks/results/peers/s19/native_loop_ab
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

from benchmarks.peers.peer_report import cpu_line, uptime, write_report

MODES = ("on", "off")


def measure(model: Path, threads: int, lm_head_bits: int, tokens: int, reps: int) -> dict:
    """Per mode: the medians of TPOT and wall time per decoded token (ms) over ``reps`` generations."""
    from moeflow import MoEModel
    from moeflow.engine import native_decode
    from moeflow.kernels.cpu import hugepages

    torch.set_num_threads(threads)
    m = MoEModel.from_pretrained(model, device="cpu", lm_head_bits=lm_head_bits, progress=False)
    hugepages.wait_collapsed(120)
    calls, inner = [0], native_decode.decode_chunk

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)

    native_decode.decode_chunk = counted
    rows: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    outs = {}
    try:
        ids = torch.randint(3, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        kw = dict(do_sample=False, eos_token_id=[], max_new_tokens=tokens + 1)
        with torch.inference_mode():
            for rep in range(reps + 1):  # (the first round: warm-up)
                for mode in MODES if rep % 2 else MODES[::-1]:
                    os.environ[native_decode.NATIVE_LOOP_ENV] = "1" if mode == "on" else "0"
                    calls[0] = 0
                    t0 = time.perf_counter()
                    outs[mode] = m.generate(ids, **kw)
                    wall = time.perf_counter() - t0
                    if (calls[0] > 0) != (mode == "on"):
                        raise SystemExit(f"{model}: native loop {mode} but {calls[0]} native chunks ran")
                    if rep:
                        rows[mode].append((m.stats.tpot_s * 1e3, (wall - m.stats.ttft_s) / tokens * 1e3))
    finally:
        native_decode.decode_chunk = inner
        m.close()
    if not torch.equal(outs["on"], outs["off"]):
        raise SystemExit(f"{model}: the native loop's tokens differ from the per-token path's")
    med = {mode: (statistics.median(r[0] for r in rows[mode]), statistics.median(r[1] for r in rows[mode]))
           for mode in MODES}
    return {"threads": threads, "lm_head_bits": lm_head_bits, "tpot_on_ms": med["on"][0], "tpot_off_ms": med["off"][0],
            "wall_on_ms": med["on"][1], "wall_off_ms": med["off"][1], "reps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lm-head-bits", type=int, nargs="+", default=[8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    cpu = cpu_line()
    before = uptime()
    results = []
    for t in args.threads:
        os.environ["OMP_NUM_THREADS"] = str(t)  # (the native library's team, as cpu_side_by_side's workers)
        for b in args.lm_head_bits:  # (each in a fresh process)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                results.append(pool.submit(measure, args.model, t, b, args.tokens, args.reps).result())
    lines = [f"Native multi-token decode loop on vs off (`MOEFLOW_NATIVE_LOOP`), `{args.model}`, batch 1, greedy, "
             f"{args.tokens + 1} new tokens after a 16-token prompt, on/off alternating, median of {args.reps} each; "
             f"the same tokens both ways (checked). CPU: {cpu}.  ",
             f"uptime before: `{before}`, after: `{uptime()}`", "",
             "| threads | lm_head_bits | TPOT on ms | TPOT off ms | TPOT off/on | wall/token on ms | "
             "wall/token off ms | wall off/on |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['lm_head_bits']} | {r['tpot_on_ms']:.3f} | {r['tpot_off_ms']:.3f} | "
              f"{r['tpot_off_ms'] / r['tpot_on_ms']:.3f}x | {r['wall_on_ms']:.3f} | {r['wall_off_ms']:.3f} | "
              f"{r['wall_off_ms'] / r['wall_on_ms']:.3f}x |" for r in results]
    write_report(args.out, {"model": str(args.model), "cpu": cpu, "results": results}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
