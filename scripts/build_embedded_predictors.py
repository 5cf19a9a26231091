#!/usr/bin/env python
"""Train the predictors shipped with the embedded tiny model (``moeflow/data/tiny-mixtral-awq/predictors/``).

One command:

1. prompts: cut from the tiny model's TRAINING text (``scripts/train_tiny_model.py``'s ``collect_corpus`` /
   ``split_corpus``; the held-out blocks, from which ``scripts/predictor_prompts.jsonl`` is cut, are never
   used here), ``--prompts-per-block`` pieces of ``--prompt-bytes`` bytes from every ``--block-stride``-th
   4096-byte training block;
2. trace: prefill + greedy decode of each prompt, routing, MoE inputs and embeddings (``moeflow trace --hidden``);
3. ``duoserve`` (distance 1, ExpertMLP with narrowed widths so the file stays small) and ``promoe``
   (distance 2, the paper's stride) trained on 90 % of the sequences; ``finemoe``: the Expert Map Store
   warmed with the training tokens (capacity ``--finemoe-capacity``);
4. each written to ``<model>/predictors/<kind>.pt`` where the policies find them
   (``OffloadConfig(policy="duoserve")`` etc.); a summary (held-out figures, sizes) to ``predictors/README.json``.

    python -m scripts.build_embedded_predictors                 # the embedded model, ~3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODEL = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"
BLOCK = 4096
# small enough to ship (a few hundred KB), and the predictor table found DuoServe's accuracy flat in the widths
DUOSERVE_WIDTHS = [256, 128, 64, 32, 16, 8]


def training_text() -> bytes:
    """The tiny model's training bytes, from its training script's own split."""
    from scripts.train_tiny_model import collect_corpus, split_corpus

    data, _ = collect_corpus()
    train, _ = split_corpus(data)
    return train


def training_prompts(prompt_bytes: int, per_block: int, stride: int) -> list[str]:
    """``per_block`` prompts from every ``stride``-th training block, each starting at a word."""
    data = training_text()
    prompts = []
    for b in range(0, len(data), BLOCK * stride):
        chunk = data[b : b + BLOCK]
        step = max(len(chunk) // per_block, 1)
        for j in range(per_block):
            text = chunk[j * step : j * step + prompt_bytes + 16].decode("utf-8", errors="ignore")
            if j:
                cut = next((i for i, c in enumerate(text) if c.isspace()), 0)
                text = text[cut:]
            text = text.lstrip()[:prompt_bytes]
            if len(text) >= prompt_bytes // 2:
                prompts.append(text)
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--out-dir", type=Path, default=None, help="default: <model>/predictors")
    p.add_argument("--prompt-bytes", type=int, default=160)
    p.add_argument("--prompts-per-block", type=int, default=2)
    p.add_argument("--block-stride", type=int, default=4, help="use every n-th training block")
    p.add_argument("--max-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=90.0, help="training time cap per learned predictor")
    p.add_argument("--finemoe-capacity", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None, help="keep the trace here (default: build/embedded-predictors)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    from moeflow import MoEOffloadedMixtral
    from moeflow.offload.predictors import evaluate_held_out, train_predictor
    from moeflow.tools.record import record_trace

    out_dir = args.out_dir or args.model / "predictors"
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = args.trace or ROOT / "build" / "embedded-predictors" / "trace.safetensors"
    trace_path.parent.mkdir(parents=True, exist_ok=True)

    model = MoEOffloadedMixtral.from_pretrained(args.model, device="cpu")
    prompts = training_prompts(args.prompt_bytes, args.prompts_per_block, args.block_stride)[: args.max_prompts]
    ids = [model.tokenizer.encode(t) for t in prompts]
    start = time.perf_counter()
    trace = record_trace(model, ids, args.max_new_tokens, hidden=True)
    trace.metadata.update(prompts="training text of scripts/train_tiny_model.py (build_embedded_predictors.py)")
    trace.save(trace_path)
    trace_s = time.perf_counter() - start
    print(f"traced {len(ids)} training-text prompts, {len(trace)} tokens in {trace_s:.0f} s", flush=True)

    summary: dict = {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "model_sha": _file_digest(args.model / "model.safetensors"),
        "trace": {"prompts": len(ids), "tokens": len(trace), "max_new_tokens": args.max_new_tokens,
                  "source": "training text (train_tiny_model.split_corpus), never the held-out blocks",
                  "seconds": round(trace_s, 1)},
        "torch": torch.__version__, "predictors": {},
    }
    jobs = [
        ("duoserve", {"epochs": args.epochs, "widths": DUOSERVE_WIDTHS, "max_seconds": args.max_seconds}),
        ("promoe", {"epochs": args.epochs, "max_seconds": args.max_seconds}),
        ("finemoe", {"capacity": args.finemoe_capacity}),
    ]
    for kind, opts in jobs:
        start = time.perf_counter()
        pred = train_predictor(kind, trace, eval_fraction=0.1, seed=args.seed, **opts)
        built_s = time.perf_counter() - start
        held = evaluate_held_out(pred, trace)
        path = pred.save(out_dir / f"{kind}.pt")
        summary["predictors"][kind] = {
            "file": path.name, "bytes": path.stat().st_size, "distance": pred.distance, "build_s": round(built_s, 1),
            "held_out": {k: round(held[k], 4) for k in ("exact_topk", "at_least_one", "recall", "precision")},
            "popularity_recall": round(held["popularity"]["recall"], 4), "options": pred.config(),
        }
        print(f"{kind}: {path} ({path.stat().st_size / 1024:.0f} KiB), held-out recall {held['recall']:.3f} "
              f"(popularity {held['popularity']['recall']:.3f}), {built_s:.0f} s", flush=True)
    (out_dir / "README.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


def _file_digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


if __name__ == "__main__":
    raise SystemExit(main())
