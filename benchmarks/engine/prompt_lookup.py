"""Prompt lookup decoding against plain greedy decoding on the embedded model: decode tok/s, drafts kept, and
that the tokens are equal. Models and settings take turns inside every repeat (a noisy machine shifts them alike).

    python -m benchmarks.engine.prompt_lookup [--repeats 5] [--out results/prompt_lookup/<date>.json]
    python -m benchmarks.engine.prompt_lookup --device cuda [--no-cuda-graphs]   # fp16; CUDA graphs by default

On CUDA the decode step is captured (both the one-token step and prompt lookup's verify step of
1 + prompt_lookup_num_tokens tokens); ``--no-cuda-graphs`` runs every pass eagerly, for the comparison. Rows say
how many captured steps the run replayed and how many passes ran eagerly.

Then the serving engine (``moeflow serve --prompt-lookup N``'s, in process; rows with ``"section": "serve"``): each
prompt alone through an engine that does not draft and one drafting N tokens, both warmed up (on CUDA: their decode
passes, drafted ones included, replay captured steps), decode tok/s from each reply's first token to its last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.kv_slots import SlotKVCache

PROMPTS = {  # what prompt lookup is for (a reply that quotes its prompt) and plain continuation
    "code-edit": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n    return",
    "prose": "The import statement",
}
SETTINGS = {"resident": dict(policy="resident"), "lru-16-slots": dict(policy="lru", gpu_expert_slots=16)}


def run_once(model, ids: torch.Tensor, new_tokens: int, lookup: int | None) -> tuple[float, torch.Tensor, int, int]:
    model.stats.reset()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, prompt_lookup_num_tokens=lookup)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    elapsed = time.perf_counter() - start
    return elapsed, out, model.stats.draft_tokens, model.stats.accepted_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--lookups", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="cpu (fp32, one thread) or cuda (fp16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="on CUDA: every pass eager (the comparison)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    load = dict(device=args.device, dtype=torch.float16 if cuda else torch.float32,
                cuda_graphs=cuda and not args.no_cuda_graphs)
    if not cuda:
        torch.set_num_threads(1)
    models = {name: MoEOffloadedMixtral.from_pretrained(embedded_model_path(), offload=OffloadConfig(**cfg), **load)
              for name, cfg in SETTINGS.items()}
    tok = next(iter(models.values())).tokenizer
    rows = []
    for prompt_name, prompt in PROMPTS.items():
        ids = torch.tensor([tok.encode(prompt)], device=args.device)
        times: dict[tuple, list[float]] = {}
        facts: dict[tuple, tuple] = {}
        passes: dict[tuple, tuple[int, int]] = {}  # (captured steps replayed, passes run eagerly) of the last run
        for model in models.values():  # warm-up: one-time costs (captures, compiles) out of the timings
            for lookup in [None, *args.lookups]:  # (a whole run: its drafted passes capture the verify step)
                run_once(model, ids, 8 if lookup is None else args.new_tokens, lookup)
        for _ in range(args.repeats):
            for name, model in models.items():
                want = None
                for lookup in [None, *args.lookups]:
                    graphs = model.runner.decode_fn
                    before = (getattr(graphs, "replays", 0), getattr(graphs, "eager_calls", 0))
                    elapsed, out, drafted, kept = run_once(model, ids, args.new_tokens, lookup)
                    passes[(name, lookup)] = (getattr(graphs, "replays", 0) - before[0],
                                              getattr(graphs, "eager_calls", 0) - before[1])
                    if lookup is None:
                        want = out
                    times.setdefault((name, lookup), []).append(elapsed)
                    facts[(name, lookup)] = (drafted, kept, bool(torch.equal(out, want)), out.shape[1] - ids.shape[1])
        for (name, lookup), elapsed in times.items():
            drafted, kept, equal, produced = facts[(name, lookup)]
            base = statistics.median(times[(name, None)])
            row = {"prompt": prompt_name, "setting": name, "prompt_lookup_num_tokens": lookup,
                   "tokens": produced, "median_s": round(statistics.median(elapsed), 4),
                   "tok_per_s": round(produced / statistics.median(elapsed), 1),
                   "speedup_vs_plain": round(base / statistics.median(elapsed), 3),
                   "draft_tokens": drafted, "accepted_tokens": kept, "tokens_equal_plain": equal,
                   "graph_replays": passes[(name, lookup)][0], "eager_graph_calls": passes[(name, lookup)][1]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in serve_rows(models, tok, args):
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"repeats": args.repeats, "device": args.device, "cuda_graphs": load["cuda_graphs"]}
        if not cuda:
            meta["threads"] = 1
        args.out.write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")


def serve_rows(models: dict, tok, args) -> list[dict]:
    """Per setting, prompt and N (None: no drafting): decode tok/s of one request alone through the serving engine.
    The engines of a model share one KV cache row (one owner for the captured steps; no prefix cache, so every
    request reads its prompt) and take turns: never two requests at once."""
    rows = []
    for name, model in models.items():
        cache = SlotKVCache.for_model(model, 512, max_rows=1)
        engines = {n: ContinuousEngine(model, cache, prefix_cache=False, prompt_lookup=n)
                   for n in [None, *args.lookups]}
        graphs = model.runner.decode_fn
        for engine in engines.values():  # (all before any starts: a warm-up borrows the free row)
            engine.warm_up()
        for engine in engines.values():
            engine.start()
        captures = getattr(graphs, "captures", 0)
        try:
            for prompt_name, prompt in PROMPTS.items():
                ids, times, facts = tok.encode(prompt), {}, {}
                for repeat in range(args.repeats + 1):  # (the first round untimed: a larger key bucket's capture)
                    for n, engine in engines.items():
                        before = (getattr(graphs, "replays", 0), getattr(graphs, "eager_calls", 0))
                        seq = engine.submit(ids, SamplingParams(max_new_tokens=args.new_tokens))
                        seq.result(600)
                        if repeat == 0:
                            continue
                        times.setdefault(n, []).append((len(seq.generated) - 1) / max(seq.t_last - seq.t_first, 1e-9))
                        facts[n] = (seq.generated, seq.draft_tokens, seq.accepted_tokens,
                                    getattr(graphs, "replays", 0) - before[0],
                                    getattr(graphs, "eager_calls", 0) - before[1])
                plain = statistics.median(times[None])
                for n, rates in times.items():
                    generated, drafted, kept, replays, eager = facts[n]
                    rows.append({"section": "serve", "prompt": prompt_name, "setting": name, "prompt_lookup": n,
                                 "tokens": len(generated), "decode_tok_per_s": round(statistics.median(rates), 1),
                                 "speedup_vs_plain": round(statistics.median(rates) / plain, 3),
                                 "draft_tokens": drafted, "accepted_tokens": kept,
                                 "tokens_equal_plain": generated == facts[None][0], "graph_replays": replays,
                                 "eager_graph_calls": eager,
                                 "captures_after_warm_up": getattr(graphs, "captures", 0) - captures})
        finally:
            for engine in engines.values():
                engine.stop()
    return rows


if __name__ == "__main__":
    main()
