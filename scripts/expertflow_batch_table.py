#!/usr/bin/env python
"""ExpertFlow's cache hit ratio against LRU at the paper's batch sizes, on the routing model: docs/papers.md
"ExpertFlow's hit rate vs LRU at its batch sizes" (issue 41).

    python -m scripts.expertflow_batch_table                  # after `python -m scripts.papers_tables predictors`

ExpertFlow §5.5 (Fig. 9; Switch-32, WMT16) reports its Expert Cache Engine's hit ratio against LRU at batch sizes 4, 8
and 16 over cache sizes: +15.35 to +35.67 % over LRU, and from batch 4 to 8 and 16 a fall of 3.12 / 6.05 % where
LRU falls 10.99 / 18.24 %. Here: 16 held-out prompts (every 6th line of ``scripts/predictor_prompts.jsonl``),
served by one model per run as 16 / B left-padded batches of B one after another (the cache carries over between
batches, as in a server), ``--new-tokens`` greedy tokens each, synchronous copies (exact counts), at 3 slot budgets
(25 / 50 / 75 % of every expert), for B = 1, 4, 8, 16; every run's tokens checked against the all-resident model
batched the same way.

The expertflow predictor is trained here on the papers_tables training trace less the sequences of these 16
prompts (``--max-seconds``), so that every prompt served is held out from the language model and the predictor
alike (papers_tables' split holds out 12, every 8th line: too few for batch 16), for all its epochs (no time cap,
so the same predictor on any machine). ``--predictor`` takes another file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from scripts.paper_switches import machine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "scripts" / "predictor_prompts.jsonl"
POLICIES = ["lru", "lfu", "expertflow"]
BATCHES = [1, 4, 8, 16]


def eval_lines(stride: int, count: int) -> list[int]:
    """The prompt lines served: every ``stride``-th line, the first ``count``."""
    return list(range(0, stride * count, stride))


def train_predictor_without(trace_path: Path, held_out: list[int], out: Path, max_seconds: float | None) -> dict:
    """The expertflow predictor from papers_tables' training trace (its sequence j = the j-th prompt line not divisible
    by 8) less the sequences of the ``held_out`` lines; saved to ``out`` -> what it was trained on."""
    from moeflow.offload.predictors import train_predictor
    from moeflow.trace import Trace

    if not trace_path.exists():
        raise SystemExit(f"{trace_path}: no training trace; run `python -m scripts.papers_tables predictors` first")
    trace = Trace.load(trace_path)
    lines = [i for i in range(10_000) if i % 8][: len(trace.sequence_ids())]
    if sorted(trace.sequence_ids()) != list(range(len(lines))):
        raise SystemExit(f"{trace_path}: sequence ids {trace.sequence_ids()[:4]}... are not 0..N-1 in prompt order")
    keep = [j for j, line in enumerate(lines) if line not in set(held_out)]
    t0 = time.perf_counter()
    pred = train_predictor("expertflow", trace.select(keep), eval_fraction=0.1, seed=0, max_seconds=max_seconds)
    out.parent.mkdir(parents=True, exist_ok=True)
    pred.save(out)
    return {"path": str(out), "train_sequences": len(keep), "seconds": round(time.perf_counter() - t0, 1),
            "notes": pred.train_info.notes}


def batches(prompts: list[list[int]], size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive groups of ``size`` prompts as left-padded (ids, mask) int64 [size, T]."""
    out = []
    for start in range(0, len(prompts), size):
        group = prompts[start : start + size]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        out.append((ids, mask))
    return out


def serve(model_path: Path, policy: str, slots: int | None, predictor: Path | None,
          work: list[tuple[torch.Tensor, torch.Tensor]], new_tokens: int) -> dict:
    """One model serving ``work``'s batches one after another -> per-phase counters, every prompt's new tokens."""
    from moeflow import MoEModel, OffloadConfig

    cfg = OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync",
                        predictor_path=str(predictor) if policy == "expertflow" and predictor else None)
    model = MoEModel.from_pretrained(model_path, device="cpu", kernels="torch",
                                     offload=None if policy == "resident" else cfg)
    tokens = []
    for ids, mask in work:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        tokens += out[:, ids.shape[1]:].tolist()
    s = model.stats
    fmt = getattr(model.experts, "fmt", None)
    row = {"prefill": s.prefill.__dict__.copy(), "decode": s.decode.__dict__.copy(), "tokens": tokens,
           "expert_bytes": fmt.nbytes if fmt is not None and policy != "resident" else None}
    model.close()
    return row


def hit(st: dict) -> float | None:
    n = st["hits"] + st["misses"]
    return st["hits"] / n if n else None


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main(argv: list[str] | None = None) -> int:
    from moeflow import MoEModel
    from moeflow.tools.record import read_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "build" / "routing-qwen3moe")
    p.add_argument("--tables", type=Path, default=ROOT / "build" / "papers-tables",
                   help="papers_tables' --out (its train.trace.safetensors)")
    p.add_argument("--predictor", type=Path, default=None,
                   help="expertflow predictor file (default: trained here, see the docstring)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="cap on the predictor's training (default: none, all its epochs: the same predictor on every "
                        "machine; papers_tables' 90 s cap is not reached there)")
    p.add_argument("--stride", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=BATCHES)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75])
    p.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    p.add_argument("--out", type=Path, default=None, help="JSON (default: <tables>/expertflow_batch.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    before, start = machine(), time.perf_counter()
    lines_served = eval_lines(args.stride, args.prompts)
    trained = None
    predictor = args.predictor
    if predictor is None and "expertflow" in args.policies:
        predictor = args.tables / f"expertflow-heldout{args.stride}x{args.prompts}.pt"
        if not predictor.exists():
            trained = train_predictor_without(args.tables / "train.trace.safetensors", lines_served, predictor,
                                              args.max_seconds)
            print(json.dumps(trained, default=str), flush=True)
    ref_model = MoEModel.from_pretrained(args.model, device="cpu", kernels="torch")
    allp = read_prompts(PROMPTS, ref_model.tokenizer)
    prompts = [allp[i] for i in lines_served]
    total = len(ref_model.family.moe_layers) * ref_model.family.num_experts
    ref_model.close()
    budgets = [round(total * f) for f in args.fractions]
    md = ["| slots | batch | policy | hit decode | hit prefill | hit all | decode experts moved / token | "
          "expertflow − lru, decode (points) | = resident |", "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    refs = {b: serve(args.model, "resident", None, None, batches(prompts, b), args.new_tokens)["tokens"]
            for b in args.batches}
    for slots in budgets:
        for b in args.batches:
            got = {}
            for policy in args.policies:
                r = serve(args.model, policy, slots, predictor, batches(prompts, b), args.new_tokens)
                d, pf = r["decode"], r["prefill"]
                both = {"hits": d["hits"] + pf["hits"], "misses": d["misses"] + pf["misses"]}
                row = {"slots": slots, "batch": b, "policy": policy, "prefill": pf, "decode": d,
                       "expert_bytes": r["expert_bytes"], "same_tokens": r["tokens"] == refs[b]}
                rows.append(row)
                got[policy] = hit(d)
                diff = (f"{100 * (got[policy] - got['lru']):+.1f}" if policy == "expertflow" and "lru" in got
                        and got[policy] is not None and got["lru"] is not None else "")
                md.append(f"| {slots} | {b} | {policy} | {pct(hit(d))} | {pct(hit(pf))} | {pct(hit(both))} | "
                          f"{d['bytes_h2d'] / max(d['tokens'], 1) / r['expert_bytes']:.2f} | {diff} | "
                          f"{'yes' if row['same_tokens'] else 'NO'} |")
                print(md[-1], flush=True)
    text = "\n".join(md)
    print(text)
    out = args.out or args.tables / "expertflow_batch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "markdown": text, "budgets": budgets, "prompt_lines": lines_served,
                               "predictor": str(predictor), "trained": trained, "machine": before,
                               "machine_after": machine(), "seconds": round(time.perf_counter() - start, 1),
                               "model": str(args.model)}, indent=1, default=str))
    print(f"{time.perf_counter() - start:.1f} s; {before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
