#!/usr/bin/env python
"""ExpertFlow on the embedded tiny model, measured: the tables of docs/expertflow.md.

One command:

1. trace: prefill + greedy decode of every held-out prompt (``scripts/predictor_prompts.jsonl``, cut from the
   blocks ``scripts/train_tiny_model.py`` holds out; the shipped predictor was trained on training text only)
   to ``build/expertflow-table/trace.safetensors``;
2. predictor: per-token ``exact_topk`` / ``recall`` and the batch-level accuracy of eq. 7 at batch sizes 1, 4,
   16, 32 of the shipped ``predictors/expertflow.pt``, beside the popularity baseline;
3. rebatching: batches of B consecutive held-out sequences, each decode step split into micro-batches of
   ``m = max(1, B // 2)``; activated (layer, expert) pairs per micro-batch without regrouping (contiguous),
   regrouped by the previous step's observed paths (what ``generate(micro_batch_size=m)`` does), by the
   predictor's paths for the step's own tokens, and by the step's true paths (an oracle bound);
4. cache: ``generate`` over the first ``--gen-prompts`` held-out prompts at each batch size (micro-batches of m,
   regrouped), policy ``lru`` against ``expertflow`` at the same slot budgets: hit rate and bytes moved per
   token (synchronous transport, so the numbers do not depend on timing);
5. the markdown replaces the block between the ``expertflow-table`` markers of docs/expertflow.md; raw figures
   go to ``build/expertflow-table/results.json``.

    python -m scripts.expertflow_table          # ~5 min on 2 shared CPU cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODEL = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"
PROMPTS = ROOT / "scripts" / "predictor_prompts.jsonl"
DOC = ROOT / "docs" / "expertflow.md"
BEGIN, END = "<!-- expertflow-table:begin -->", "<!-- expertflow-table:end -->"
BATCH_SIZES = (1, 4, 16, 32)


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def rebatch_pairs(trace, scores: torch.Tensor, top_k: int, batch: int, max_new: int) -> dict:
    """Mean activated (layer, expert) pairs per micro-batch over every decode step, four ways of grouping."""
    from moeflow.offload.policies.expertflow.scheduler import activated_pairs, group_by_routing
    from moeflow.offload.predictors.base import topk_mask

    m = max(1, batch // 2)
    seqs = trace.sequence_ids()
    true_mask = trace.topk_mask()
    pred_mask = topk_mask(scores.reshape(-1, scores.shape[-1]), top_k).reshape(scores.shape)
    totals = {"none": 0, "observed": 0, "predicted": 0, "oracle": 0}
    groups_n = 0
    for b0 in range(0, len(seqs) - batch + 1, batch):
        rows_of = []
        for s in seqs[b0 : b0 + batch]:
            rows = torch.nonzero(trace.seq_id == s).flatten()
            rows_of.append(rows[torch.argsort(trace.pos[rows])])
        prompt = [int((trace.phase[r] == 0).sum()) for r in rows_of]
        steps = min(r.numel() - p for r, p in zip(rows_of, prompt, strict=True))  # decode rows of every sequence
        for s in range(steps):
            now = torch.stack([r[p + s] for r, p in zip(rows_of, prompt, strict=True)])  # row of this step
            prev = torch.stack([r[p + s - 1] for r, p in zip(rows_of, prompt, strict=True)])  # previous token
            paths = true_mask[now]
            contiguous = [list(range(i, min(i + m, batch))) for i in range(0, batch, m)]
            ways = {"none": contiguous,
                    "observed": group_by_routing(true_mask[prev], m),
                    "predicted": group_by_routing(pred_mask[now], m),
                    "oracle": group_by_routing(paths, m)}
            for name, groups in ways.items():
                totals[name] += activated_pairs(paths, groups)
            groups_n += len(contiguous)
    return {"micro_batch": m, "micro_batches": groups_n,
            **{k: (v / groups_n if groups_n else None) for k, v in totals.items()}}


def run_cache(model_path: Path, predictor: Path, prompts: list[list[int]], policy: str, slots: int, batch: int,
              max_new: int) -> dict:
    """generate() over the prompts in batches of ``batch`` (left-padded, micro-batches of batch // 2, regrouped)."""
    from moeflow import MoEOffloadedMixtral, OffloadConfig
    from moeflow.offload.predictors import load_predictor

    model = MoEOffloadedMixtral.from_pretrained(model_path, offload=OffloadConfig(
        policy=policy, gpu_expert_slots=slots, transport="sync", predictor_path=str(predictor)))
    paths = load_predictor(predictor)
    m = max(1, batch // 2)
    model.stats.reset()
    tokens = 0
    for b0 in range(0, len(prompts) - batch + 1, batch):
        group = prompts[b0 : b0 + batch]
        width = max(len(p) for p in group)
        ids = torch.zeros((batch, width), dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=[],
                       micro_batch_size=m if batch > 1 else None, path_predictor=paths if batch > 1 else None)
        tokens += batch * max_new
    st = model.stats
    hits = st.prefill.hits + st.decode.hits
    need = hits + st.prefill.misses + st.decode.misses
    dec_need = st.decode.hits + st.decode.misses
    return {
        "policy": policy, "slots": slots, "batch": batch, "micro_batch": m if batch > 1 else None,
        "hit_rate": hits / max(need, 1), "decode_hit_rate": st.decode.hits / max(dec_need, 1),
        "bytes_per_token": (st.prefill.bytes_h2d + st.decode.bytes_h2d) / max(tokens, 1),
        "decode_bytes_per_token": st.decode.bytes_h2d / max(st.decode.tokens, 1),
        "prefetches": st.prefill.prefetches + st.decode.prefetches,
        "useful_prefetches": st.prefill.useful_prefetches + st.decode.useful_prefetches,
        "generated_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--predictor", type=Path, default=None, help="default: <model>/predictors/expertflow.pt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gen-prompts", type=int, default=32, help="held-out prompts generated for the cache table")
    p.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    p.add_argument("--out-dir", type=Path, default=ROOT / "build" / "expertflow-table")
    p.add_argument("--no-doc", action="store_true", help="print the tables only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from moeflow import MoEOffloadedMixtral
    from moeflow.offload.policies.expertflow.predictor import batch_level_report
    from moeflow.offload.predictors import load_predictor
    from moeflow.tools.record import read_prompts, record_trace
    from moeflow.trace import Trace

    predictor_path = args.predictor or args.model / "predictors" / "expertflow.pt"
    pred = load_predictor(predictor_path)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256((args.model / "model.safetensors").read_bytes()).hexdigest()[:16]
    trace_path = args.out_dir / "trace.safetensors"
    tag = f"{digest}|{args.max_new_tokens}|{PROMPTS.stat().st_mtime_ns}"
    model = MoEOffloadedMixtral.from_pretrained(args.model)
    prompts = read_prompts(PROMPTS, model.tokenizer)
    if not trace_path.is_file() or Trace.load(trace_path).metadata.get("table_tag") != tag:
        start = time.perf_counter()
        trace = record_trace(model, prompts, args.max_new_tokens)
        trace.metadata.update(table_tag=tag, prompts=PROMPTS.name)
        trace.save(trace_path)
        print(f"traced {len(prompts)} held-out prompts, {len(trace)} tokens in {time.perf_counter() - start:.0f} s",
              flush=True)
    trace = Trace.load(trace_path)
    cfg = model.config
    L, E, k = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    del model

    # predictor accuracy (every row of the held-out trace: none of it was trained on)
    acc_all = pred.evaluate_trace(trace).as_dict()
    acc_dec = pred.evaluate_trace(trace, "decode").as_dict()
    batch_level = batch_level_report(pred, trace)
    scores = pred.trace_scores(trace)
    print(json.dumps({"all": {k_: acc_all[k_] for k_ in ("exact_topk", "recall")}, "batch_level": batch_level}),
          flush=True)
    from moeflow.offload.predictors import PopularityPredictor, evaluate

    pop = evaluate(PopularityPredictor(pred.shape, 1, pred.popularity), trace).as_dict()

    pairs = {b: rebatch_pairs(trace, scores, k, b, args.max_new_tokens) for b in BATCH_SIZES}
    print(json.dumps(pairs), flush=True)

    cache_rows = []
    gen_prompts = prompts[: args.gen_prompts]
    for slots in args.slots:
        for batch in BATCH_SIZES:
            for policy in ("lru", "expertflow"):
                start = time.perf_counter()
                r = run_cache(args.model, predictor_path, gen_prompts, policy, slots, batch, args.max_new_tokens)
                r["seconds"] = round(time.perf_counter() - start, 1)
                print(json.dumps(r), flush=True)
                cache_rows.append(r)

    raw = {"model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
           "model_sha": digest, "predictor": pred.describe(), "trace_tokens": len(trace),
           "accuracy": {"all": acc_all, "decode": acc_dec, "popularity": pop}, "batch_level": batch_level,
           "rebatch_pairs": pairs, "cache": cache_rows}
    (args.out_dir / "results.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")

    n_seq = len(trace.sequence_ids())
    lines = [
        f"Model `{raw['model']}` ({L} layers, {E} experts, top-{k}; {L * E} (layer, expert) pairs, model "
        f"sha256 {digest}); predictor `{predictor_path.name}` ({pred.train_info.notes.get('parameters', '?')} "
        f"parameters, window {pred.window}, trained on {pred.train_info.train_tokens} tokens of training text). "
        f"Held-out prompts: {n_seq} (scripts/predictor_prompts.jsonl), prefill + {args.max_new_tokens} greedy "
        f"tokens each, {len(trace)} tokens. CPU, torch {torch.__version__}, Python {platform.python_version()}. "
        f"Made by `python -m scripts.expertflow_table`.",
        "",
        "**Predictor** (every held-out token; all layers predicted before the pass):",
        "",
        "| | exact top-k | recall | recall (decode) | popularity exact / recall |",
        "|---|---|---|---|---|",
        f"| expertflow | {pct(acc_all['exact_topk'])} | {pct(acc_all['recall'])} | {pct(acc_dec['recall'])} | "
        f"{pct(pop['exact_topk'])} / {pct(pop['recall'])} |",
        "",
        "**Batch-level accuracy** (eq. 7 as read here: 1 − Hamming(P, P̂)/(L·E) of the OR-ed [L, E] paths of B "
        "random held-out tokens), with recall / IoU of the active entries and the popularity baseline's accuracy:",
        "",
        "| batch size | batches | true active pairs | accuracy | recall | precision | IoU | exact "
        "| popularity accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in BATCH_SIZES:
        f = batch_level[str(b)]
        lines.append(f"| {b} | {f['batches']} | {f['active']:.1f} | {pct(f['accuracy'])} | {pct(f['recall'])} | "
                     f"{pct(f['precision'])} | {pct(f['iou'])} | {pct(f['exact'])} | "
                     f"{pct(f['popularity_accuracy'])} |")
    lines += [
        "",
        "**Activated (layer, expert) pairs per micro-batch**, decode steps of batches of B consecutive held-out "
        f"sequences, micro-batches of m = max(1, B/2) (of {L * E} pairs):",
        "",
        "| batch B | micro-batch m | micro-batches | no rebatching | rebatched, previous step's paths (generate) "
        "| rebatched, predicted paths | rebatched, true paths (oracle) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in BATCH_SIZES:
        r = pairs[b]
        lines.append(f"| {b} | {r['micro_batch']} | {r['micro_batches']} | {r['none']:.2f} | {r['observed']:.2f} | "
                     f"{r['predicted']:.2f} | {r['oracle']:.2f} |")
    lines += [
        "",
        f"**Cache**: `generate` over the first {len(gen_prompts)} held-out prompts, batches of B (left-padded), "
        f"micro-batches of B/2 regrouped every step (B = 1: no micro-batching), {args.max_new_tokens} new tokens, "
        "synchronous transport, warm start. Hit rate over every needed expert (prefill and decode); bytes moved "
        "host→device per generated token, all phases and decode only:",
        "",
        "| slots | batch B | lru hit % | expertflow hit % | lru decode hit % | expertflow decode hit % "
        "| lru KiB/token | expertflow KiB/token | lru decode KiB/token | expertflow decode KiB/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["slots"], r["batch"], r["policy"]): r for r in cache_rows}
    for slots in args.slots:
        for b in BATCH_SIZES:
            a, x = by[(slots, b, "lru")], by[(slots, b, "expertflow")]
            lines.append(
                f"| {slots}/{L * E} | {b} | {pct(a['hit_rate'])} | {pct(x['hit_rate'])} | "
                f"{pct(a['decode_hit_rate'])} | {pct(x['decode_hit_rate'])} | {a['bytes_per_token'] / 1024:.1f} | "
                f"{x['bytes_per_token'] / 1024:.1f} | {a['decode_bytes_per_token'] / 1024:.1f} | "
                f"{x['decode_bytes_per_token'] / 1024:.1f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_doc:
        text = DOC.read_text(encoding="utf-8") if DOC.is_file() else f"# ExpertFlow\n\n{BEGIN}\n{END}\n"
        if BEGIN not in text:
            text += f"\n{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}", encoding="utf-8")
        print(f"updated {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
