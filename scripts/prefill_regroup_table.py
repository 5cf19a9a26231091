#!/usr/bin/env python
"""ExpertFlow's token scheduler in prefill, measured: docs/papers.md "ExpertFlow's token scheduler in prefill"
(issue 41; ``Mechanisms.prefill_regroup``, moeflow/offload/token_groups.py).

    python -m scripts.prefill_regroup_table     # routing model; after `python -m scripts.papers_tables predictors`

The first ``--batch`` evaluation prompts (every 8th line of ``scripts/predictor_prompts.jsonl``) prefilled as one
left-padded batch under expertflow, synchronous copies (exact counts), ``--new-tokens`` greedy tokens, at 3 slot
budgets. Each MoE layer of the prefill computes its experts for every token at once (*one group*, the default), or
for two token micro-batches of the tokens of all prompts regrouped by the predicted paths' Hamming similarity (the
paper's clustering, or moeflow's variant: the token order unless the clustering activates fewer pairs), or the
prefill runs as two micro-batches of whole prompts (``generate(micro_batch_size=batch/2)``: the policy's
scheduler groups the prompts, each micro-batch a pass of its own). Columns: the prefill's hits and misses per layer
pass (an expert two micro-batches need counts twice), experts loaded (misses) and moved (misses + prefetches) per
prompt token, the (layer, expert) pairs of the predicted token paths the two token micro-batches activate against
the token order's, and the tokens against the all-resident model's.
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
# (label, policy_options, micro_batch_size: None or "half")
MODES = [("one group (off)", {}, None),
         ("2 token micro-batches, paper's clustering", {"prefill_regroup": True, "keep_contiguous": False}, None),
         ("2 token micro-batches, moeflow's variant", {"prefill_regroup": True, "keep_contiguous": True}, None),
         ("2 micro-batches of whole prompts", {}, "half")]


def main(argv: list[str] | None = None) -> int:
    from moeflow import MoEModel, OffloadConfig
    from moeflow.tools.record import read_prompts
    from scripts.expertflow_batch_table import batches

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "build" / "routing-qwen3moe")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "papers-tables" / "prefill_regroup.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    before, start = machine(), time.perf_counter()
    ref = MoEModel.from_pretrained(args.model, device="cpu", kernels="torch")
    prompts = read_prompts(PROMPTS, ref.tokenizer)[::8][: args.batch]
    (ids, mask), = batches(prompts, len(prompts))
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
    total = len(ref.family.moe_layers) * ref.family.num_experts
    ref.close()
    lines = ["| slots | prefill MoE as | hits | misses | experts loaded / prompt token | "
             "experts moved / prompt token | predicted pairs (vs token order) | = resident |",
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    for slots in [round(total * f) for f in args.fractions]:
        for label, options, micro in MODES:
            cfg = OffloadConfig(policy="expertflow", gpu_expert_slots=slots, transport="sync",
                                policy_options=options or None)
            model = MoEModel.from_pretrained(args.model, device="cpu", kernels="torch", offload=cfg)
            size = -(-len(prompts) // 2) if micro == "half" else None
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                 micro_batch_size=size)
            pf, nb = model.stats.prefill, model.experts.fmt.nbytes
            st = model.experts.predictor.state
            regrouped = st.prefill_regroups > 0
            row = {"slots": slots, "mode": label, "prefill": pf.__dict__.copy(), "expert_bytes": nb,
                   "regroups": st.prefill_regroups, "pairs": st.prefill_pairs,
                   "contiguous_pairs": st.prefill_contiguous_pairs, "same_tokens": torch.equal(out, want)}
            model.close()
            rows.append(row)
            pairs = f"{st.prefill_pairs} ({st.prefill_contiguous_pairs})" if regrouped else "–"
            lines.append(f"| {slots} | {label} | {pf.hits} | {pf.misses} | {pf.misses / pf.tokens:.3f} | "
                         f"{pf.bytes_h2d / nb / pf.tokens:.3f} | {pairs} | {'yes' if row['same_tokens'] else 'NO'} |")
            print(lines[-1], flush=True)
    md = "\n".join(lines)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "markdown": md, "machine": before, "machine_after": machine(),
                                    "prompt_tokens": int(mask.sum()), "seconds": round(time.perf_counter() - start, 1),
                                    "model": str(args.model)}, indent=1, default=str))
    print(f"{time.perf_counter() - start:.1f} s; {before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
