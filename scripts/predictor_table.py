#!/usr/bin/env python
"""Held-out accuracy of every expert predictor on the embedded tiny model, as the table in docs/predictors.md.

One command does everything:

1. prompts: cut from the tiny model's *held-out* text (``scripts/train_tiny_model.py``'s corpus split: every
   20th 4096-byte block of Python's pydoc topics and stdlib docstrings), written to
   ``scripts/predictor_prompts.jsonl`` (kept when it exists, so the table is reproducible);
2. trace: prefill + greedy decode of every prompt, recording routing, MoE inputs and embeddings
   (``moeflow trace --hidden``) to ``build/predictor-table/trace.safetensors``;
3. for each predictor (and distance): build it from 90 % of the sequences, evaluate on the other 10 %
   (``train_predictor`` / ``evaluate_held_out``), all tokens and decode tokens only;
4. the markdown table replaces the block between the ``predictor-table`` markers of docs/predictors.md;
   the raw figures go to ``build/predictor-table/results.json``.

    python -m scripts.predictor_table                       # build/tiny-mixtral-fp32, else the embedded AWQ model
    python -m scripts.predictor_table --model PATH --prompts-per-block 12 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ROOT / "scripts" / "predictor_prompts.jsonl"
DOC = ROOT / "docs" / "predictors.md"
BEGIN, END = "<!-- predictor-table:begin -->", "<!-- predictor-table:end -->"
MODELS = (ROOT / "build" / "tiny-mixtral-fp32", ROOT / "moeflow" / "data" / "tiny-mixtral-awq")
# (kind, distance or None for the paper's): each learned predictor at the next layer and at its paper distance
CONFIGS = [
    ("popularity", 1),
    ("skip-gate", 1),
    ("duoserve", 1),
    ("promoe", 1),
    ("finemoe", 1),
    ("skip-gate", 2),
    ("duoserve", 2),
    ("promoe", 2),
    ("finemoe", 2),
    ("finemoe", 3),
]


def heldout_text() -> bytes:
    """The tiny model's held-out bytes, from its training script's own split."""
    from scripts.train_tiny_model import collect_corpus, split_corpus

    data, _ = collect_corpus()
    _, heldout = split_corpus(data)
    return heldout


def make_prompts(path: Path, prompt_bytes: int, per_block: int, block: int = 4096) -> int:
    """Cut ``per_block`` prompts of about ``prompt_bytes`` bytes from each held-out block (starting at a word)."""
    data = heldout_text()
    lines = []
    for b in range(0, len(data), block):
        chunk = data[b : b + block]
        step = len(chunk) // per_block
        for j in range(per_block):
            piece = chunk[j * step : j * step + prompt_bytes + 16]
            text = piece.decode("utf-8", errors="ignore")
            if j:  # start at a word boundary
                cut = next((i for i, c in enumerate(text) if c.isspace()), 0)
                text = text[cut:]
            text = text.lstrip()[:prompt_bytes]
            if len(text) >= prompt_bytes // 2:
                lines.append(json.dumps({"prompt": text, "source": f"held-out block {b // block}, piece {j}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def fmt(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: build/tiny-mixtral-fp32, else the AWQ one)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-bytes", type=int, default=160)
    p.add_argument("--prompts-per-block", type=int, default=12)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--retrace", action="store_true", help="record the trace again even when it exists")
    p.add_argument("--out-dir", default=str(ROOT / "build" / "predictor-table"))
    p.add_argument("--no-doc", action="store_true", help="print the table only")
    args = p.parse_args()
    torch.set_num_threads(1)

    from moeflow import MoEOffloadedMixtral
    from moeflow.offload.predictors import evaluate_held_out, train_predictor
    from moeflow.tools.record import read_prompts, record_trace
    from moeflow.trace import Trace

    model_path = Path(args.model) if args.model else next((m for m in MODELS if (m / "config.json").is_file()), None)
    if model_path is None:
        print("error: no tiny model yet (build/tiny-mixtral-fp32 or moeflow/data/tiny-mixtral-awq)", file=sys.stderr)
        return 2
    if not PROMPTS.is_file():
        n = make_prompts(PROMPTS, args.prompt_bytes, args.prompts_per_block)
        print(f"wrote {n} held-out prompts to {PROMPTS.relative_to(ROOT)}", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "trace.safetensors"
    tag = f"{model_path.resolve()}|{args.max_new_tokens}|{PROMPTS.stat().st_mtime_ns}"
    if args.retrace or not trace_path.is_file() or Trace.load(trace_path).metadata.get("table_tag") != tag:
        model = MoEOffloadedMixtral.from_pretrained(model_path, device="cpu")
        prompts = read_prompts(PROMPTS, model.tokenizer)
        start = time.perf_counter()
        trace = record_trace(model, prompts, args.max_new_tokens, hidden=True, progress=True)
        trace.metadata.update(table_tag=tag, prompts=PROMPTS.name)
        trace.save(trace_path)
        print(f"traced {len(prompts)} prompts, {len(trace)} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    trace = Trace.load(trace_path)

    rows, raw = [], []
    for kind, distance in CONFIGS:
        if distance >= trace.num_layers:
            continue
        opts: dict = {}
        if kind in ("duoserve", "promoe"):
            opts["epochs"] = args.epochs
        if kind == "skip-gate":
            opts["model"] = model_path
        start = time.perf_counter()
        pred = train_predictor(kind, trace, eval_fraction=args.eval_fraction, seed=args.seed, distance=distance,
                               **opts)
        train_s = time.perf_counter() - start
        res = evaluate_held_out(pred, trace)
        dec = evaluate_held_out(pred, trace, phase="decode")
        raw.append({"kind": kind, "distance": distance, "train_seconds": train_s, "all": res, "decode": dec})
        pop = res["popularity"]
        rows.append(
            f"| {kind} | {distance} | {fmt(res['exact_topk'])} | {fmt(res['at_least_one'])} | {fmt(res['recall'])} "
            f"| {fmt(res['precision'])} | {res['mean_predicted']:.2f} | {fmt(dec['recall'])} "
            f"| {fmt(pop['recall'])} / {fmt(pop['exact_topk'])} | {fmt(res['first_layers']['recall'])} "
            f"| {train_s:.1f} |"
        )
        print(rows[-1], flush=True)

    info = trace.metadata
    sequences = trace.sequence_ids()
    held = raw[0]["all"]["held_out_sequences"] if raw else 0
    header = (
        f"Model `{Path(trace.model).name}` ({trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}, "
        f"hidden {trace.hidden_size}); {len(sequences)} held-out-text prompts ({PROMPTS.relative_to(ROOT)}), "
        f"prefill + {info.get('max_new_tokens', '?')} greedy tokens each, {len(trace)} tokens traced; predictors "
        f"built from {len(sequences) - held} sequences and evaluated on the other {held} "
        f"({raw[0]['all']['tokens'] if raw else 0} tokens). Figures in %, over every (token, layer >= distance) "
        f"pair; popularity is evaluated on the same pairs; \"layers < d\": the first layers, guessed before the "
        f"forward pass routes anything (popularity, FineMoE's semantic search). CPU, torch {torch.__version__}, Python "
        f"{platform.python_version()}. Made by `python -m scripts.predictor_table`."
    )
    table = "\n".join([
        header, "",
        "| predictor | distance | exact top-k | at least one | recall | precision | experts predicted "
        "| recall (decode) | popularity recall / exact | recall, layers < d | build s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    (out_dir / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    print(table)
    if not args.no_doc and DOC.is_file():
        text = DOC.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
            print(f"updated {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
