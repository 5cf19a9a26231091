"""Two questions about the native decode loop (issue 42, engine/native_decode.py), one loaded model, batch 1,
greedy, ``device="cpu"``, ``MOEFLOW_NATIVE_LOOP`` on / off alternating rep by rep (the order flipped every rep):

1. Does the first token of each native chunk cost more than the others? With the loop on, each token's time is
   the C loop's own timestamps (``mf_decode_loop``'s ``times``: from the call's start, then each token's end, so
   no Python is inside); with it off, each ``PlainDecode.step``'s wall time (the Python glue included). Reported per
   kind of token: the first decoded token after the prefill, the first token of each later chunk, the others; and
   the minor page faults (``getrusage``) over each chunk's native call.
2. Is a 32-token prompt's prefill (``generate(prompt 32, max_new_tokens=1)``) slower right after a looped decode
   than after a per-token one? TTFT and the process CPU time of that call, paired with the other mode's in the same
   rep: the median of the per-rep ratios, how many reps were slower, and a bootstrap 95 % interval of that median.

Each rep per mode: ``generate(16-token prompt, 33 new tokens)`` with ``--chunk`` tokens per native call (4: a
streamer's ``STREAM_CHUNK``; 256: ``MAX_CHUNK``, all 32 at once), then the 32-token prefill.

    python -m benchmarks.peers.native_loop_chunk --model /tmp/peers/awq-qa --threads 1 2 --chunk 4 --reps 60 \\
        --out benchmarks/results/peers/s19/chunk_c4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.peers.peer_report import cpu_line, uptime, write_report

MODES = ("on", "off")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(model: Path, threads: int, chunk: int, reps: int) -> dict:
    """Per mode and rep: each decoded token's ms, the faults per native chunk, the pp32's TTFT and CPU ms."""
    from moeflow import MoEModel
    from moeflow.engine import native_decode
    from moeflow.engine.decode import PlainDecode
    from moeflow.kernels.cpu import hugepages

    torch.set_num_threads(threads)
    m = MoEModel.from_pretrained(model, device="cpu", progress=False)
    hugepages.wait_collapsed(120)
    tokens: list[float] = []
    faults: list[int] = []
    inner_chunk, inner_step, old_max = native_decode.decode_chunk, PlainDecode.step, native_decode.MAX_CHUNK

    def timed_chunk(*a, **kw):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        toks, times = inner_chunk(*a, **kw)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        tokens.extend((b - t) * 1e3 for t, b in zip(times, times[1:], strict=False))
        return toks, times

    def timed_step(self, *a, **kw):
        t0 = time.perf_counter()
        out = inner_step(self, *a, **kw)
        tokens.append((time.perf_counter() - t0) * 1e3)
        return out

    native_decode.decode_chunk, PlainDecode.step, native_decode.MAX_CHUNK = timed_chunk, timed_step, chunk
    g = torch.Generator().manual_seed(0)
    dec = torch.randint(3, m.config.vocab_size, (1, 16), generator=g)
    pp = torch.randint(3, m.config.vocab_size, (1, 32), generator=g)
    kw = dict(do_sample=False, eos_token_id=[])
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        with torch.inference_mode():
            for rep in range(reps + 1):  # (the first round: warm-up)
                for mode in MODES if rep % 2 else MODES[::-1]:
                    os.environ[native_decode.NATIVE_LOOP_ENV] = "1" if mode == "on" else "0"
                    tokens.clear()
                    faults.clear()
                    m.generate(dec, max_new_tokens=33, **kw)
                    if len(tokens) != 32:
                        raise SystemExit(f"{model}: {len(tokens)} decode tokens timed, expected 32 ({mode})")
                    c0 = _cpu_s()
                    m.generate(pp, max_new_tokens=1, **kw)
                    if rep:
                        rows[mode].append({"tokens": list(tokens), "faults": list(faults), "pp_ttft": m.stats.ttft_s
                                           * 1e3, "pp_cpu": (_cpu_s() - c0) * 1e3})
    finally:
        native_decode.decode_chunk, PlainDecode.step, native_decode.MAX_CHUNK = inner_chunk, inner_step, old_max
        m.close()
    return {"threads": threads, "chunk": chunk, "reps": rows}


def _kinds(rows: list[dict], chunk: int) -> tuple[float, float, float]:
    """Medians (ms) of: the first decoded token, the first token of each later chunk, the others."""
    first = [r["tokens"][0] for r in rows]
    heads = [r["tokens"][i] for r in rows for i in range(chunk, 32, chunk)]
    others = [r["tokens"][i] for r in rows for i in range(1, 32) if i % chunk]
    med = statistics.median
    return med(first), med(heads) if heads else float("nan"), med(others)


def _paired(on: list[float], off: list[float]) -> tuple[float, int, float, float]:
    """on/off per rep: the median ratio, how many reps on > off, a bootstrap 95 % interval of the median."""
    d = [a / b for a, b in zip(on, off, strict=True)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(2000))
    return statistics.median(d), sum(x > 1 for x in d), boots[50], boots[1949]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--chunk", type=int, default=4, help="tokens per native call (4: a streamer's)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    cpu = cpu_line()
    before = uptime()
    results = []
    for t in args.threads:
        os.environ["OMP_NUM_THREADS"] = str(t)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results.append(pool.submit(measure, args.model, t, args.chunk, args.reps).result())
    lines = [f"Native loop: chunk heads and pp32 after a looped decode (`native_loop_chunk.py`), `{args.model}`, "
             f"{args.chunk} tokens per native call, on/off alternating, {args.reps} reps each. CPU: {cpu}.  ",
             f"uptime before: `{before}`, after: `{uptime()}`", "",
             "Per decoded token, median ms (on: the C loop's own timestamps; off: `PlainDecode.step`, glue "
             "included); faults: minor page faults over each native call (max over all chunks).", "",
             "| threads | mode | 1st token after prefill | 1st token of later chunks | other tokens | "
             "chunk heads / others | faults per chunk (max) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for mode in MODES:
            first, heads, others = _kinds(r["reps"][mode], args.chunk)
            flt = max((f for x in r["reps"][mode] for f in x["faults"]), default=0) if mode == "on" else "-"
            lines.append(f"| {r['threads']} | {mode} | {first:.3f} | {heads:.3f} | {others:.3f} | "
                         f"{heads / others:.3f} | {flt} |")
    lines += ["", "pp32 right after the decode, on vs off (per-rep ratio on/off):", "",
              "| threads | TTFT on ms | TTFT off ms | median ratio | reps on slower | 95 % CI | CPU ms on | "
              "CPU ms off | median ratio | reps on slower | 95 % CI |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        on, off = r["reps"]["on"], r["reps"]["off"]
        cells = [f"| {r['threads']} "]
        for key in ("pp_ttft", "pp_cpu"):
            a, b = [x[key] for x in on], [x[key] for x in off]
            ratio, slower, lo, hi = _paired(a, b)
            cells.append(f"| {statistics.median(a):.2f} | {statistics.median(b):.2f} | {ratio:.4f} | "
                         f"{slower}/{len(a)} | {lo:.4f}-{hi:.4f} ")
        lines.append("".join(cells) + "|")
    write_report(args.out, {"model": str(args.model), "cpu": cpu, "results": results}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
