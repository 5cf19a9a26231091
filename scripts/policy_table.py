#!/usr/bin/env python
"""Hit rate and bytes moved host->device per generated token of every offload policy, as the table in
docs/policies.md. Measured on the embedded tiny model's held-out prompts, never assumed.

One command:

1. prompts: ``scripts/predictor_prompts.jsonl`` (cut from the tiny model's held-out text by
   ``scripts/predictor_table.py``), every ``--stride``-th of them;
2. for each policy and slot budget: load the model with ``OffloadConfig(policy, gpu_expert_slots, transport="sync")``
   (CPU, synchronous copies: deterministic counts) and serve the prompts one after another (prefill, then
   ``--max-new-tokens`` greedy tokens each; the cache and FineMoE's store carry over from request to request,
   as in serving); record the runtime's counters and check the tokens against ``resident``;
3. the Markdown table replaces the block between the ``policy-table`` markers of docs/policies.md; the raw
   figures go to ``build/policy-table/results.json``.

The predictor policies use the predictors shipped with the model (``<model>/predictors/``, built by
``scripts/build_embedded_predictors.py`` from the training text).

    python -m scripts.policy_table                      # ~5 min on 2 CPU cores
    python -m scripts.policy_table --budgets 4,8,16 --stride 6 --max-new-tokens 24 --no-doc
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODEL = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"
PROMPTS = ROOT / "scripts" / "predictor_prompts.jsonl"
DOC = ROOT / "docs" / "policies.md"
BEGIN, END = "<!-- policy-table:begin -->", "<!-- policy-table:end -->"
POLICIES = ["ondemand", "lru", "lfu", "mixtral-offloading", "duoserve", "promoe", "finemoe", "expertflow", "auto"]


def load_prompts(model, stride: int) -> list[list[int]]:
    from moeflow.tools.record import read_prompts

    return read_prompts(PROMPTS, model.tokenizer)[::stride]


def run(job: tuple[str, int | None, str, int, int]) -> dict:
    """Serve every prompt with one policy at one budget; the runtime's counters over all of them."""
    policy, slots, model_path, stride, new_tokens = job
    torch.set_num_threads(1)
    from moeflow import MoEOffloadedMixtral, OffloadConfig
    from moeflow.errors import SchedulingError

    start = time.perf_counter()
    cfg = OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync")
    try:
        # one kernel for every run (resident would otherwise take the bf16 int4 CPU kernels, offloaded runs the
        # fp32 torch reference, and their greedy tokens may part after many steps)
        model = MoEOffloadedMixtral.from_pretrained(model_path, device="cpu", offload=cfg, kernels="torch")
    except SchedulingError as e:  # e.g. a predictor file not built yet: report it, keep the other rows
        return {"policy": policy, "slots": slots, "error": str(e)}
    outs = []
    for ids in load_prompts(model, stride):
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        outs.append(out[0, len(ids):].tolist())
    s = model.stats
    experts = model.experts
    row = {
        "policy": policy, "slots": slots, "ran": getattr(experts, "policy_name", policy),
        "prefill": s.prefill.__dict__.copy(), "decode": s.decode.__dict__.copy(), "outputs": outs,
        "expert_bytes": experts.fmt.nbytes if hasattr(experts, "fmt") else None, "seconds": time.perf_counter() - start,
    }
    if hasattr(experts, "close"):
        experts.close()
    return row


def registered_policies(names: list[str]) -> list[str]:
    from moeflow.offload import POLICY_TABLE

    return [p for p in names if p in POLICY_TABLE]


def figures(row: dict, generated: int) -> dict:
    pre, dec = row["prefill"], row["decode"]
    nbytes = row["expert_bytes"] or 1

    def rate(h: int, m: int) -> float | None:
        return h / (h + m) if h + m else None

    moved = pre["bytes_h2d"] + dec["bytes_h2d"]
    return {
        "hit_decode": rate(dec["hits"], dec["misses"]),
        "hit_prefill": rate(pre["hits"], pre["misses"]),
        "bytes_per_token": moved / generated,
        "experts_per_token": moved / generated / nbytes,
        "decode_bytes_per_token": dec["bytes_h2d"] / max(dec["steps"], 1),
        "decode_experts_per_token": dec["bytes_h2d"] / max(dec["steps"], 1) / nbytes,
        "prefetch_useful": (dec["useful_prefetches"] / dec["prefetches"]) if dec["prefetches"] else None,
        "stall_s_per_token": (pre["stall_s"] + dec["stall_s"]) / generated,
    }


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--budgets", default="4,8,16", help="slot counts (the tiny model has 4 x 8 = 32 experts)")
    p.add_argument("--policies", default=",".join(POLICIES), help="unregistered names are skipped")
    p.add_argument("--stride", type=int, default=8, help="use every n-th held-out prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=ROOT / "build" / "policy-table")
    p.add_argument("--no-doc", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from moeflow import MoEOffloadedMixtral

    budgets = [int(b) for b in args.budgets.split(",")]
    policies = registered_policies(args.policies.split(","))
    ref_model = MoEOffloadedMixtral.from_pretrained(args.model, device="cpu")
    cfg = ref_model.config
    total = cfg.num_hidden_layers * cfg.num_local_experts
    n_prompts = len(load_prompts(ref_model, args.stride))
    del ref_model
    model = str(args.model)
    jobs = [("resident", None, model, args.stride, args.max_new_tokens)]
    jobs += [(pol, b, model, args.stride, args.max_new_tokens) for b in budgets for pol in policies]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        rows = list(pool.map(run, jobs))
    ref = rows[0]
    generated = sum(len(o) for o in ref["outputs"])
    results, failed = [], []
    for row in rows[1:]:
        if "error" in row:
            failed.append(row)
            continue
        row.update(figures(row, generated), tokens_equal=row["outputs"] == ref["outputs"])
        results.append({k: v for k, v in row.items() if k != "outputs"})
    wall = time.perf_counter() - start

    expert_kib = results[0]["expert_bytes"] / 1024 if results else 0
    head = (
        f"Model `{args.model.name}` ({cfg.num_hidden_layers} layers x {cfg.num_local_experts} experts = {total}, "
        f"top-{cfg.num_experts_per_tok}, one AWQ expert = {expert_kib:.1f} KiB); {n_prompts} held-out prompts "
        f"(every {args.stride}th line of scripts/predictor_prompts.jsonl), each prefilled then {args.max_new_tokens} "
        f"greedy tokens, served one after another on one model ({generated} generated tokens); synchronous "
        f"transport on the CPU. Hit rate: needed experts found resident or already loading at the gate. Moved: "
        f"host->device bytes of prefill and decode together per generated token, also in experts (bytes / expert "
        f"size); decode: decode-step bytes per decode step. Useful: decode prefetches used at their gate. Every run "
        f"gave exactly `resident`'s tokens: {all(r['tokens_equal'] for r in results)}. torch {torch.__version__}, "
        f"Python {platform.python_version()}. Made by `python -m scripts.policy_table` in {wall:.0f} s."
    )
    lines = [head, "", "| slots | policy | hit rate decode | hit rate prefill | moved KiB / token | experts / token "
             "| decode experts / step | useful prefetches | = resident |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ran = r["policy"] if r["ran"] == r["policy"] else f"{r['policy']} ({r['ran']})"
        lines.append(
            f"| {r['slots']} ({100 * r['slots'] / total:.0f} %) | {ran} | {pct(r['hit_decode'])} | "
            f"{pct(r['hit_prefill'])} | {r['bytes_per_token'] / 1024:.1f} | {r['experts_per_token']:.2f} | "
            f"{r['decode_experts_per_token']:.2f} | {pct(r['prefetch_useful'])} | "
            f"{'yes' if r['tokens_equal'] else 'NO'} |"
        )
    for r in failed:
        lines.append(f"| {r['slots']} | {r['policy']} | not run: {r['error'].split(';')[0]} |" + " |" * 6)
    table = "\n".join(lines)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(
        {"model": model, "prompts": n_prompts, "generated_tokens": generated, "budgets": budgets,
         "rows": results, "not_run": failed}, indent=1) + "\n", encoding="utf-8")
    if not args.no_doc:
        text = DOC.read_text(encoding="utf-8")
        if BEGIN not in text or END not in text:
            print(f"error: {DOC} lacks the {BEGIN} / {END} markers", file=sys.stderr)
            return 2
        before, rest = text.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        DOC.write_text(before + BEGIN + "\n" + table + "\n" + END + after, encoding="utf-8")
        print(f"updated {DOC.relative_to(ROOT)}")
    return 0 if all(r["tokens_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
