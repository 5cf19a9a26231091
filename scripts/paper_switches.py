#!/usr/bin/env python
"""Each paper-or-variant switch (``Mechanisms``, ``OffloadConfig.policy_options``) measured both ways, as the tables
in docs/papers.md. One command:

    python -m scripts.paper_switches            # counts (CPU, synchronous copies) + simulator timings
    python -m scripts.paper_switches --skip counts --skip timings --routing-model build/routing-qwen3moe

1. **Counts** (switches that change what moves): every switch that decides *which* experts move (ProMoE's
   refresh on prefetch, FineMoE's prefill iteration, DuoServe's predictor in prefill) on the embedded model's
   held-out prompts (every ``--stride``-th line of scripts/predictor_prompts.jsonl, prefill then
   ``--max-new-tokens`` greedy tokens each, one model serving them in turn), at three slot budgets, with the
   synchronous transport (deterministic counts). Every run's tokens are checked against ``resident``.
2. **Token scheduler** (ExpertFlow §3.3): on the recorded routing of the same prompts, pairs of batches of decode
   tokens, the (layer, expert) pairs they activate as they came and regrouped both ways.
3. **Timings** (switches that change *when* bytes move: the copy queue's order and chunking): the simulator
   (moeflow.sim) replays a trace of the same prompts through the real policy code on the ``pcie4-24gb`` profile
   (Mixtral-8x7B expert sizes; the routing is the tiny model's), each variant registered as a user policy.

Raw figures: ``build/paper-switches/results.json``; the Markdown goes to stdout (pasted into docs/papers.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from scripts.policy_table import MODEL, figures, load_prompts, pct

ROOT = Path(__file__).resolve().parents[1]

# (switch, policy, the paper's value, moeflow's variant)
COUNT_SWITCHES = [
    ("refresh_on_prefetch", "promoe", True, False),
    ("prefill_iteration", "finemoe", "pass", "token"),
    ("predict_in_prefill", "duoserve", False, True),
]
TIME_SWITCHES = [
    ("queue_priority", "finemoe", True, False),
    ("prefetch_chunks", "promoe", "per-linear", "pieces"),
]


def serve(policy: str, slots: int | None, options: dict, stride: int, new_tokens: int, model_path=MODEL) -> dict:
    from moeflow import MoEModel, OffloadConfig

    cfg = OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync", policy_options=options or None)
    model = MoEModel.from_pretrained(model_path, device="cpu", offload=cfg, kernels="torch")
    outs = []
    prompts = load_prompts(model, stride)
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        outs.append(out[0, len(ids):].tolist())
    s, experts = model.stats, model.experts
    row = {"prefill": s.prefill.__dict__.copy(), "decode": s.decode.__dict__.copy(), "outputs": outs,
           "expert_bytes": getattr(experts, "fmt", None) and experts.fmt.nbytes,
           "goodpred": s.decode.goodpred, "accuracy": s.decode.prefetch_accuracy}
    if hasattr(experts, "close"):
        experts.close()
    return row


def counts_table(budgets: list[int], stride: int, new_tokens: int) -> tuple[list[dict], str]:
    ref = serve("resident", None, {}, stride, new_tokens)
    generated = sum(len(o) for o in ref["outputs"])
    rows, lines = [], ["| switch | policy | slots | way | hit decode | hit prefill | moved KiB / token | "
                       "useful prefetches | = resident |", "|---|---|---|---|---|---|---|---|---|"]
    for switch, policy, paper, variant in COUNT_SWITCHES:
        for slots in budgets:
            for way, value in (("paper", paper), ("moeflow", variant)):
                row = serve(policy, slots, {switch: value}, stride, new_tokens)
                f = figures(row, generated)
                same = row["outputs"] == ref["outputs"]
                rows.append({"switch": switch, "policy": policy, "slots": slots, "way": way, "value": value,
                             **f, "same_tokens": same})
                lines.append(f"| `{switch}` | {policy} | {slots} | {way} (`{value}`) | {pct(f['hit_decode'])} | "
                             f"{pct(f['hit_prefill'])} | {f['bytes_per_token'] / 1024:.1f} | "
                             f"{pct(f['prefetch_useful'])} | {'yes' if same else 'NO'} |")
                print(lines[-1], flush=True)
    return rows, "\n".join(lines)


def record(stride: int, new_tokens: int):
    """The routing trace of the held-out prompts (prefill + greedy decode, with hidden states and embeddings)."""
    from moeflow import MoEOffloadedMixtral
    from moeflow.tools.record import record_trace

    model = MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu")
    return record_trace(model, load_prompts(model, stride), new_tokens, hidden=True, embed=True, progress=False)


def scheduler_table(trace, sizes: tuple[int, ...] = (4, 8, 16), draws: int = 50) -> tuple[list[dict], str]:
    """ExpertFlow §3.3 on recorded routing: two batches of N decode tokens (drawn at random from the trace's
    decode rows), the (layer, expert) pairs they activate as they came, regrouped by moeflow's variant (the
    clustering only where it activates fewer) and by the paper's clustering as written."""
    from moeflow.offload.policies.expertflow.scheduler import activated_pairs, group_by_routing

    paths_all = trace.topk_mask()[trace.phase == 1]  # [N, L, E] bool, decode tokens
    gen = torch.Generator().manual_seed(0)
    rows, lines = [], ["| tokens per batch | as they came | moeflow (clustering if fewer) | paper (clustering) | "
                       "paper vs as they came |", "|---|---|---|---|---|"]
    for n in sizes:
        sums = {"orig": 0, "variant": 0, "paper": 0}
        for _ in range(draws):
            idx = torch.randperm(paths_all.shape[0], generator=gen)[: 2 * n]
            paths = paths_all[idx]
            sums["orig"] += activated_pairs(paths, [list(range(n)), list(range(n, 2 * n))])
            sums["variant"] += activated_pairs(paths, group_by_routing(paths, n, keep_contiguous=True))
            sums["paper"] += activated_pairs(paths, group_by_routing(paths, n, keep_contiguous=False))
        mean = {k: v / draws for k, v in sums.items()}
        rows.append({"tokens_per_batch": n, "draws": draws, **mean})
        lines.append(f"| {n} | {mean['orig']:.1f} | {mean['variant']:.1f} | {mean['paper']:.1f} | "
                     f"{100 * (mean['paper'] / mean['orig'] - 1):+.1f} % |")
    return rows, "\n".join(lines)


def timings_table(trace, budgets: list[int], profile_name: str) -> tuple[list[dict], str]:
    from moeflow.offload.policies import POLICY_TABLE, register_policy, unregister_policy
    from moeflow.sim import get_profile, simulate
    from moeflow.sim.simulator import load_gates

    gates = load_gates(MODEL, trace.num_layers)
    # the routing is the tiny model's, the costs the profile's model's (as scripts/make_sim_report.py does)
    profile = dataclasses.replace(get_profile(profile_name), num_layers=None, num_experts=None, top_k=None)
    rows, lines = [], ["| switch | policy | slots | way | decode ms / token | TTFT ms | decode stall ms / step | "
                       "decode hit rate | useful prefetches |", "|---|---|---|---|---|---|---|---|---|"]
    for switch, policy, paper, variant in TIME_SWITCHES:
        for slots in budgets:
            for way, value in (("paper", paper), ("moeflow", variant)):
                name = f"{policy}-{switch}-{way}"
                spec = POLICY_TABLE[policy]
                register_policy(dataclasses.replace(spec, name=name, mechanisms=dataclasses.replace(
                    spec.mechanisms, **{switch: value})))
                try:
                    res = simulate(trace, name, slots, profile, gates=gates, timeline=False, predictor_dir=MODEL)
                finally:
                    unregister_policy(name)
                row = {"switch": switch, "policy": policy, "slots": slots, "way": way, "value": value,
                       **res.as_dict()}
                rows.append(row)
                useful = res.useful_prefetches / res.prefetches if res.prefetches else None
                lines.append(f"| `{switch}` | {policy} | {slots} | {way} (`{value}`) | {_ms(res.tpot_s)} | "
                             f"{_ms(res.ttft_s)} | {_ms(res.decode_stall_s / max(res.decode_steps, 1))} | "
                             f"{pct(res.decode_hit_rate)} | {pct(useful)} |")
                print(lines[-1], flush=True)
    return rows, "\n".join(lines)


def model_table(model_path: Path, policies: list[str], budgets: list[int], stride: int,
                new_tokens: int) -> tuple[list[dict], str]:
    """Every policy in ``policies`` at each budget on another checkpoint (the routing model): hit rates and bytes."""
    ref = serve("resident", None, {}, stride, new_tokens, model_path)
    generated = sum(len(o) for o in ref["outputs"])
    rows, lines = [], ["| slots | policy | hit decode | hit prefill | moved experts / token | decode experts / step | "
                       "useful prefetches | = resident |", "|---|---|---|---|---|---|---|---|"]
    for slots in budgets:
        for policy in policies:
            row = serve(policy, slots, {}, stride, new_tokens, model_path)
            f = figures(row, generated)
            same = row["outputs"] == ref["outputs"]
            rows.append({"policy": policy, "slots": slots, **f, "same_tokens": same})
            lines.append(f"| {slots} | {policy} | {pct(f['hit_decode'])} | {pct(f['hit_prefill'])} | "
                         f"{f['experts_per_token']:.2f} | {f['decode_experts_per_token']:.2f} | "
                         f"{pct(f['prefetch_useful'])} | {'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
    return rows, "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} cores; uptime: {load}; torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="4,8,16")
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--profile", default="pcie4-24gb")
    p.add_argument("--skip", choices=["counts", "timings"], action="append", default=[], help="repeatable")
    p.add_argument("--routing-model", type=Path, default=None,
                   help="also serve --model-policies on this checkpoint (scripts/train_routing_model.py's)")
    p.add_argument("--model-policies", default="lru,lfu,mixtral-offloading,finemoe")
    p.add_argument("--model-budgets", default="64,128,256")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "paper-switches" / "results.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    start = time.perf_counter()
    out: dict = {"machine": machine(), "args": vars(args) | {"out": str(args.out)}}
    if "counts" not in args.skip:
        out["counts"], md = counts_table(budgets, args.stride, args.max_new_tokens)
        print(md)
    if "timings" not in args.skip:
        trace = record(args.stride, args.max_new_tokens)
        out["scheduler"], md = scheduler_table(trace)
        print(md)
        out["timings"], md = timings_table(trace, budgets, args.profile)
        print(md)
    if args.routing_model is not None:
        out["routing_model"], md = model_table(args.routing_model, args.model_policies.split(","),
                                               [int(b) for b in args.model_budgets.split(",")], args.stride,
                                               args.max_new_tokens)
        print(md)
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["machine_after"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"{out['seconds']} s; {out['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
