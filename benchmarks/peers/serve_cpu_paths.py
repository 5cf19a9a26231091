"""What one client of ``moeflow serve`` gets on the CPU against ``generate()`` (issue 42): single-stream greedy
decode tok/s and TTFT of (a) ``MoEModel.generate()`` and (b) the serving engine itself (``ContinuousEngine`` on a
``SlotKVCache`` built as ``moeflow serve`` builds it: ``--max-batch`` rows of the model's context, at most 4096;
its prefix cache off, so each rep prefills the whole prompt),
in one process per thread count, alternating, with the number of decode passes that took the one native step call
(``cpu_layers.layers_step`` wrapped with a counter, as ``decode_glue_share.py`` does) and the tokens of both
compared. ``--profile``: a cProfile of one engine run's top entries (cumulative time). The HTTP side is
``serve_side_by_side.py``.

    python -m benchmarks.peers.serve_cpu_paths --model /tmp/peers/awq-qa --threads 1 2 \\
        --out benchmarks/results/peers/s19/serve_paths_awq
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing
import os
import pstats
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.peers.peer_report import cpu_line, uptime, write_report

PROMPT_TOKENS = 16  # (the default: what generate's native attention takes in its prefill too)


def _engine_run(engine, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """(tokens, TTFT s, decode tok/s from the first token's time to the last's) of one request on ``engine``."""
    from moeflow.engine.continuous import SamplingParams

    seq = engine.submit(prompt, SamplingParams(max_new_tokens=tokens))
    out = seq.result(600)
    return out, seq.t_first - seq.t_submit, (len(out) - 1) / (seq.t_last - seq.t_first)


def measure(model_path: Path, threads: int, tokens: int, reps: int, max_batch: int, profile: bool,
            max_len: int | None = None, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """Median TTFT (ms) and decode tok/s of generate() and the engine, one request at a time, ``reps`` each."""
    from moeflow import MoEModel
    from moeflow.engine import cpu_layers
    from moeflow.engine.continuous import ContinuousEngine, SamplingParams
    from moeflow.engine.kv_slots import SlotKVCache
    from moeflow.engine.memory import DEFAULT_CONTEXT
    from moeflow.kernels.cpu import hugepages

    torch.set_num_threads(threads)
    m = MoEModel.from_pretrained(model_path, device="cpu", progress=False)
    hugepages.wait_collapsed(120)
    inner, calls = cpu_layers.layers_step, [0]

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)

    cpu_layers.layers_step = counted
    prompt = torch.randint(3, m.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    max_len = max_len or min(m.config.max_position_embeddings, DEFAULT_CONTEXT)
    # (no prefix cache: every rep sends the same prompt, which would leave one token to prefill)
    engine = ContinuousEngine(m, SlotKVCache.for_model(m, max_len, None, max_rows=max_batch),
                              prefix_cache=False).start()
    rows: dict[str, list] = {"generate": [], "engine": []}
    steps: dict[str, int] = {}
    tokens_of: dict[str, list[int]] = {}
    profile_text = ""
    try:
        with torch.inference_mode():
            m.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=[])  # warm-up
        _engine_run(engine, prompt[0].tolist(), tokens)
        for _ in range(reps):
            t0 = time.perf_counter()  # TTFT as the engine's is timed: from the call to the first token
            with torch.inference_mode():
                m.generate(prompt, max_new_tokens=1, do_sample=False, eos_token_id=[])
                ttft = time.perf_counter() - t0
                calls[0] = 0
                out = m.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=[])
            steps["generate"], tokens_of["generate"] = calls[0], out[0, prompt_tokens:].tolist()
            rows["generate"].append((ttft * 1e3, 1.0 / m.stats.tpot_s, None))
            calls[0] = 0
            got, ttft, rate = _engine_run(engine, prompt[0].tolist(), tokens)
            steps["engine"], tokens_of["engine"] = calls[0], got
            rows["engine"].append((ttft * 1e3, rate, None))
        if profile:  # (the scheduler thread stopped: its loop's passes run here, where the profiler sees them)
            engine.stop()
            engine = ContinuousEngine(m, engine.cache, prefix_cache=False)
            seq = engine.submit(prompt[0].tolist(), SamplingParams(max_new_tokens=tokens))
            prof = cProfile.Profile()
            prof.enable()
            with torch.inference_mode():
                while not seq.done:
                    engine._admit()
                    engine._iterate()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            profile_text = text.getvalue()
    finally:
        engine.stop()
        cpu_layers.layers_step = inner
        m.close()
    result = {"threads": threads, "tokens": tokens, "kv_rows": max_batch, "max_len": max_len,
              "same_tokens": tokens_of["generate"] == tokens_of["engine"],
              "first_difference": next((i for i, (a, b) in enumerate(zip(*tokens_of.values(), strict=False))
                                        if a != b), None), "profile": profile_text}
    for name, rs in rows.items():
        result[name] = {"ttft_ms": statistics.median(r[0] for r in rs),
                        "decode_tok_s": statistics.median(r[1] for r in rs), "native_steps": steps[name], "reps": rs}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--max-batch", type=int, default=16, help="the engine's KV rows (moeflow serve's --max-batch)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="the engine's context per row (moeflow serve's --max-model-len; default: its default)")
    ap.add_argument("--profile", action="store_true", help="cProfile one engine run (the first thread count)")
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    cpu = cpu_line()
    before = uptime()
    results = []
    for i, t in enumerate(args.threads):
        os.environ["OMP_NUM_THREADS"] = str(t)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results.append(pool.submit(measure, args.model, t, args.tokens, args.reps, args.max_batch,
                                       args.profile and i == 0, args.max_len,
                                       args.prompt_tokens).result())
    lines = [f"One greedy request at a time on `{args.model}`, {args.prompt_tokens}-token prompt, {args.tokens} new "
             f"tokens, median of {args.reps} (alternating). CPU: {cpu}.  ",
             f"uptime before: `{before}`, after: `{uptime()}`", "",
             "| threads | path | TTFT ms | decode tok/s | native one-call steps | engine / generate | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("generate", "engine"):
            x = r[name]
            rows = f" ({r['kv_rows']} rows x {r['max_len']})" if name == "engine" else ""
            lines.append(f"| {r['threads']} | {name}{rows} | "
                         f"{x['ttft_ms']:.1f} | {x['decode_tok_s']:.1f} | {x['native_steps']} | "
                         f"{x['decode_tok_s'] / r['generate']['decode_tok_s']:.2f}x | {r['same_tokens']} |")
    for r in results:
        if r["profile"]:
            lines += ["", f"cProfile of one engine request, {r['threads']} thread(s) (by own time):", "", "```",
                      *r["profile"].strip().splitlines()[:45], "```"]
    write_report(args.out, {"model": str(args.model), "cpu": cpu, "results": results}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
