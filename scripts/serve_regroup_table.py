#!/usr/bin/env python
"""ExpertFlow's token scheduler in the serving engine, measured: docs/papers.md's "token scheduler in the server"
table (issue 41, point 6).

    python -m scripts.serve_regroup_table                       # the embedded model (its shipped expertflow predictor)
    python -m scripts.serve_regroup_table --model build/routing-qwen3moe   # the routing model, after
                                                                # `python -m scripts.papers_tables predictors`

8 evaluation prompts (every 8th line of ``scripts/predictor_prompts.jsonl``) submitted at once to a
``ContinuousEngine`` of 8 rows under the expertflow policy, synchronous copies (exact counts), ``--new-tokens``
greedy tokens each, at 3 slot budgets; every decode step one pass over every running row (``off``), or two
micro-batches (``--micro-batch-size auto``) by row order (``contiguous``: micro-batches without regrouping), by the
paper's clustering (``clustering``) or by moeflow's variant (``policy``: the clustering unless the contiguous split
activates no more pairs). Columns: decode passes; (layer, expert) pairs a decode pass needs, on average (hits +
misses per pass: distinct experts per micro-batch); experts loaded (misses) and bytes moved (misses + prefetches,
in experts) per generated token; the scheduler's predicted pairs against the contiguous split's; every reply checked
against the all-resident model's.
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
MODES = [(None, "policy", "off (one pass)"), ("auto", "contiguous", "2 micro-batches, row order"),
         ("auto", "clustering", "2 micro-batches, paper's clustering"),
         ("auto", "policy", "2 micro-batches, moeflow's variant")]


def serve(model, prompts: list[list[int]], new_tokens: int, micro_batch_size, scheduler: str):
    from moeflow.engine.continuous import ContinuousEngine, SamplingParams
    from moeflow.engine.kv_slots import SlotKVCache

    cache = SlotKVCache.for_model(model, max(map(len, prompts)) + new_tokens, max_rows=len(prompts))
    eng = ContinuousEngine(model, cache, prefill_chunk=sum(map(len, prompts)), prefix_cache=False,
                           micro_batch_size=micro_batch_size, token_scheduler=scheduler)
    seqs = [eng.submit(p, SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    eng.start()
    try:
        return [s.result(600) for s in seqs], eng
    finally:
        eng.stop()


def main(argv: list[str] | None = None) -> int:
    from moeflow import MoEModel, OffloadConfig
    from moeflow.cli import embedded_model_path
    from moeflow.tools.record import read_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "papers-tables" / "serve_regroup.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path = args.model or embedded_model_path()
    before, start = machine(), time.perf_counter()
    ref = MoEModel.from_pretrained(path, device="cpu", kernels="torch")
    prompts = read_prompts(PROMPTS, ref.tokenizer)[::8][: args.batch]
    new = args.new_tokens
    want = [ref.generate(torch.tensor([q]), max_new_tokens=new, do_sample=False, eos_token_id=[])[0, len(q):].tolist()
            for q in prompts]
    total = ref.runner.num_moe_layers * ref.runner.num_experts
    ref.close()
    lines = ["| slots | decode steps as | passes | pairs / pass | experts loaded / token | experts moved / token | "
             "predicted pairs (vs row order) | = resident |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for slots in [round(total * f) for f in args.fractions]:
        for size, scheduler, label in MODES:
            model = MoEModel.from_pretrained(path, device="cpu", kernels="torch",
                                             offload=OffloadConfig(policy="expertflow", gpu_expert_slots=slots,
                                                                   transport="sync"))
            got, eng = serve(model, prompts, args.new_tokens, size, scheduler)
            d, nb = model.stats.decode, model.experts.fmt.nbytes
            model.experts.close()
            st = eng.regroup.stats.as_dict() if eng.regroup is not None else None
            row = {"slots": slots, "mode": label, "decode": d.__dict__.copy(), "expert_bytes": nb, "regroup": st,
                   "same_tokens": got == want}
            rows.append(row)
            pairs = f"{st['pairs']} ({st['contiguous_pairs']})" if st else "–"
            lines.append(f"| {slots} | {label} | {d.steps} | {(d.hits + d.misses) / d.steps:.1f} | "
                         f"{d.misses / d.tokens:.2f} | {d.bytes_h2d / nb / d.tokens:.2f} | {pairs} | "
                         f"{'yes' if row['same_tokens'] else 'NO'} |")
            print(lines[-1], flush=True)
    md = "\n".join(lines)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "markdown": md, "machine": before, "machine_after": machine(),
                                    "seconds": round(time.perf_counter() - start, 1), "model": str(path)}, indent=1))
    print(f"{time.perf_counter() - start:.1f} s; {before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
