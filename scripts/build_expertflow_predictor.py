#!/usr/bin/env python
"""Train the ExpertFlow routing-path predictor shipped with the embedded tiny model.

One command:

1. prompts: cut from the tiny model's TRAINING text (``scripts/train_tiny_model.py``'s ``collect_corpus`` /
   ``split_corpus``; the held-out blocks, from which ``scripts/predictor_prompts.jsonl`` is cut, are never used
   here): ``--prompts-per-block`` pieces of ``--prompt-bytes`` bytes from every ``--block-stride``-th 4096-byte
   training block, each starting at a word;
2. trace: prefill + greedy decode of each prompt (routing only, no hidden states) to ``build/expertflow/``;
3. ``train_predictor("expertflow", ...)`` on 90 % of the sequences (the rest held out and evaluated), written to
   ``moeflow/data/tiny-mixtral-awq/predictors/expertflow.pt`` where ``OffloadConfig(policy="expertflow")``
   finds it; the summary (held-out figures, batch-level accuracy, size, model digest) is printed as JSON and
   written next to the trace.

    python -m scripts.build_expertflow_predictor          # ~2-3 min on 2 shared CPU cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from scripts.build_embedded_predictors import training_prompts  # the same prompts as the other predictors

ROOT = Path(__file__).resolve().parents[1]

MODEL = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"
def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--out", type=Path, default=None, help="default: <model>/predictors/expertflow.pt")
    p.add_argument("--prompt-bytes", type=int, default=160)
    p.add_argument("--prompts-per-block", type=int, default=2)
    p.add_argument("--block-stride", type=int, default=1, help="use every n-th training block")
    p.add_argument("--max-prompts", type=int, default=320)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-seconds", type=float, default=150.0, help="training time cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "expertflow")
    p.add_argument("--retrace", action="store_true", help="record the trace again even when it exists")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    from moeflow import MoEOffloadedMixtral
    from moeflow.offload.policies.expertflow.predictor import batch_level_report
    from moeflow.offload.predictors import evaluate_held_out, held_out_rows, train_predictor
    from moeflow.tools.record import record_trace
    from moeflow.trace import Trace

    out = args.out or args.model / "predictors" / "expertflow.pt"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    trace_path = args.work_dir / "train-trace.safetensors"
    digest = file_digest(args.model / "model.safetensors")
    tag = f"{digest}|{args.prompt_bytes}|{args.prompts_per_block}|{args.block_stride}|{args.max_prompts}|" \
          f"{args.max_new_tokens}"
    trace_s = 0.0
    if args.retrace or not trace_path.is_file() or Trace.load(trace_path).metadata.get("build_tag") != tag:
        model = MoEOffloadedMixtral.from_pretrained(args.model, device="cpu")
        prompts = training_prompts(args.prompt_bytes, args.prompts_per_block, args.block_stride)[: args.max_prompts]
        ids = [model.tokenizer.encode(t) for t in prompts]
        start = time.perf_counter()
        trace = record_trace(model, ids, args.max_new_tokens)
        trace.metadata.update(build_tag=tag,
                              prompts="training text of scripts/train_tiny_model.py (build_expertflow_predictor.py)")
        trace.save(trace_path)
        trace_s = time.perf_counter() - start
        print(f"traced {len(ids)} training-text prompts, {len(trace)} tokens in {trace_s:.0f} s", flush=True)
    trace = Trace.load(trace_path)

    pred = train_predictor("expertflow", trace, eval_fraction=0.1, seed=args.seed, epochs=args.epochs,
                           max_seconds=args.max_seconds)
    pred.train_info.trace_model = str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model)
    pred.save(out)
    res = evaluate_held_out(pred, trace)
    rows = held_out_rows(pred, trace)
    summary = {
        "out": str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out), "bytes": out.stat().st_size,
        "model_sha": digest, "trace": {"sequences": len(trace.sequence_ids()), "tokens": len(trace),
                                       "seconds": round(trace_s, 1)},
        "train_seconds": round(pred.train_info.train_seconds, 1), "notes": pred.train_info.notes,
        "held_out": {k: res[k] for k in ("held_out_sequences", "exact_topk", "recall", "tokens")},
        "popularity": {k: res["popularity"][k] for k in ("exact_topk", "recall")},
        "batch_level": batch_level_report(pred, rows),
    }
    (args.work_dir / "build_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
