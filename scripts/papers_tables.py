#!/usr/bin/env python
"""The tables of docs/papers.md on the routing model (scripts/train_routing_model.py's checkpoint), issue 41.

One command per table; each prints its Markdown and writes its raw figures under ``--out`` (build/papers-tables):

    python -m scripts.papers_tables predictors   # traces + the learned policies' predictors, trained on the model
    python -m scripts.papers_tables headline     # each paper's metric beside the paper's figure
    python -m scripts.papers_tables sim          # every policy x 3 budgets, with / without the prefetch gate, batch 1
    python -m scripts.papers_tables batch8       # every policy x 3 budgets, batch-8 decode on the CPU runtime
    python -m scripts.papers_tables sim8         # the simulator at batch 8 (the same 8 prompts), beside batch8
    python -m scripts.papers_tables routing      # routing statistics beside the embedded model's and published ones
    python -m scripts.papers_tables finemoe-store  # FineMoE's map-store capacity vs recall and hit rate

Prompts: ``scripts/predictor_prompts.jsonl`` (held-out Python-docs text, held out for the routing model too: its
corpus starts with the same text and splits it the same way). Every 8th line is an evaluation prompt (12); the
other 84 are the predictors' training prompts. Traces: each prompt prefilled then ``--new-tokens`` greedy tokens,
recorded through moeflow with the MoE inputs and embeddings (``moeflow.tools.record``).

Predictors (``predictors``): duoserve, promoe, finemoe and expertflow at their papers' distances into
``<model>/predictors/`` (where the policies look), and promoe at distances 1, 2 and 3 for ProMoE's figure, each
with ``--max-seconds`` of training (``moeflow.offload.predictors.train_predictor``, one thread).

The simulator (``sim``) replays the evaluation trace through the real policy code on each profile with the
profile's costs (Mixtral-8x7B expert bytes and compute; the routing is the model's), as scripts/paper_switches.py
does; the gate rows run the same policy with ``Mechanisms.prefetch_gate`` on. ``batch8`` serves 8 evaluation
prompts as one left-padded batch on the CPU (synchronous copies: exact counts) and checks the tokens against
resident; the gate there uses this machine's own accounting (wall-clock layer periods, a measured memory copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from scripts.paper_switches import machine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "scripts" / "predictor_prompts.jsonl"
POLICIES = ["lru", "lfu", "mixtral-offloading", "duoserve", "promoe", "finemoe", "expertflow"]
PREDICTIVE = {"mixtral-offloading", "duoserve", "promoe", "finemoe", "expertflow"}
KINDS = ["duoserve", "promoe", "finemoe", "expertflow"]
PROFILES = ["pcie4-24gb", "h100-pcie5"]


def prompts(model) -> tuple[list[list[int]], list[list[int]]]:
    """(training prompts, evaluation prompts): every 8th line of PROMPTS evaluates."""
    from moeflow.tools.record import read_prompts

    allp = read_prompts(PROMPTS, model.tokenizer)
    return [p for i, p in enumerate(allp) if i % 8], allp[::8]


def traces(model_path: Path, out: Path, new_tokens: int):
    """The training and evaluation traces (recorded once, then read back)."""
    from moeflow import MoEModel
    from moeflow.tools.record import record_trace
    from moeflow.trace import Trace

    paths = out / "train.trace.safetensors", out / "eval.trace.safetensors"
    if all(p.exists() for p in paths):
        return tuple(Trace.load(p) for p in paths)
    model = MoEModel.from_pretrained(model_path, device="cpu", dtype=torch.float32)
    got = []
    for p, ids in zip(paths, prompts(model), strict=True):
        t = record_trace(model, ids, new_tokens, hidden=True, embed=True, progress=False)
        t.save(p)
        got.append(t)
    return tuple(got)


def cmd_predictors(args) -> dict:
    from moeflow.offload.predictors import evaluate_held_out, train_predictor

    train, ev = traces(args.model, args.out, args.new_tokens)
    pdir = args.model / "predictors"
    pdir.mkdir(exist_ok=True)
    rows = {}
    jobs = [(k, None, pdir / f"{k}.pt") for k in args.kinds]
    jobs += [("promoe", d, args.out / f"promoe-d{d}.pt") for d in (1, 3) if "promoe" in args.kinds]
    for kind, distance, path in jobs:
        opts = {} if kind == "finemoe" else {"max_seconds": args.max_seconds}
        t0 = time.perf_counter()
        pred = train_predictor(kind, train, eval_fraction=0.1, seed=0, distance=distance, **opts)
        pred.save(path)
        res = evaluate_held_out(pred, ev, "decode")
        rows[path.name if distance else kind] = {"path": str(path), "distance": pred.distance,
                                                 "seconds": round(time.perf_counter() - t0, 1),
                                                 "decode_recall": res.get("recall"), "notes": pred.train_info.notes}
        print(json.dumps(rows[path.name if distance else kind], default=str), flush=True)
    return {"predictors": rows, "train_tokens": len(train), "eval_tokens": len(ev)}


def layer_copy_ms(profile_name: str, top_k: int) -> tuple[float, float]:
    """(one decode layer: attention + top_k experts at one token, one expert's copy) in ms, on the profile."""
    from moeflow.sim import get_profile

    p = get_profile(profile_name)
    return (p.attn_s(1) + top_k * p.expert_s(1)) * 1e3, p.copy_s() * 1e3


def cmd_headline(args) -> dict:
    from moeflow.offload.policies.expertflow.predictor import batch_level_report
    from moeflow.offload.predictors import evaluate_held_out, load_predictor
    from moeflow.offload.predictors.evaluate import goodpred

    _, ev = traces(args.model, args.out, args.new_tokens)
    pdir = args.model / "predictors"
    out: dict = {}
    duo = load_predictor(pdir / "duoserve.pt")
    for phase in ("all", "decode"):
        out[f"duoserve_{phase}"] = evaluate_held_out(duo, ev, phase)
    layer_ms, copy_ms = layer_copy_ms("pcie4-24gb", ev.top_k)
    out["layer_ms"], out["copy_ms"] = layer_ms, copy_ms
    for d, path in ((1, args.out / "promoe-d1.pt"), (2, pdir / "promoe.pt"), (3, args.out / "promoe-d3.pt")):
        res = evaluate_held_out(load_predictor(path), ev, "decode")
        res["goodpred"] = goodpred(res, d, layer_ms=layer_ms, expert_ms=copy_ms, predict_ms=0.2)
        out[f"promoe_d{d}"] = res
    ef = load_predictor(pdir / "expertflow.pt")
    out["expertflow"] = evaluate_held_out(ef, ev, "decode")
    from moeflow.offload.predictors import held_out_rows

    out["expertflow_batch_level"] = batch_level_report(ef, held_out_rows(ef, ev), phase="decode")
    out["finemoe"] = evaluate_held_out(load_predictor(pdir / "finemoe.pt"), ev, "decode")
    f = lambda x: "–" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    d0 = out["duoserve_decode"]
    lines = ["| paper's metric | paper's figure | moeflow on the routing model (decode tokens) |",
             "| --- | --- | --- |",
             f"| DuoServe Table 3: every needed expert predicted, distance 1 | 66.9 % (top-2 of 8) | "
             f"{f(d0.get('exact_topk'))} (all 8 of 64; popularity {f(d0['popularity'].get('exact_topk'))}) |",
             f"| DuoServe Table 3: at least one predicted | 95.5 % | {f(d0.get('at_least_one'))} |",
             f"| DuoServe: recall (needed experts predicted) | – | {f(d0.get('recall'))} (popularity "
             f"{f(d0['popularity'].get('recall'))}) |"]
    for d in (1, 2, 3):
        r = out[f"promoe_d{d}"]
        g = r["goodpred"]
        lines.append(f"| ProMoE Fig. 8 / §4.1, distance {d}: recall; GoodPred (`pcie4-24gb`) | 84.7 % accuracy "
                     f"(mean); GoodPred highest at its stride | recall {f(r.get('recall'))}, precision "
                     f"{f(r.get('precision'))}; FetchRate {f(g['fetch_rate'])}, GoodPred {f(g['goodpred'])} |")
    bl = out["expertflow_batch_level"]
    lines.append("| ExpertFlow eq. 7: batch-level accuracy at batch " + " / ".join(bl) + " | 73.6–87.0 % at batch 8–32 "
                 "(its Table 1, Switch-32/64/128) | " + " / ".join(f(bl[b].get("accuracy")) for b in bl)
                 + f"; recall {f(out['expertflow'].get('recall'))} |")
    lines.append(f"| FineMoE: recall of the map store (δ-threshold sets) | – | {f(out['finemoe'].get('recall'))}, "
                 f"{out['finemoe'].get('mean_predicted', 0):.1f} experts per layer guessed |")
    out["markdown"] = "\n".join(lines)
    print(out["markdown"])
    return out


def coverage90(trace) -> list[float]:
    """Per layer: the share of the experts that, hottest first, carry 90 % of the routed (token, expert) pairs."""
    mask = trace.topk_mask().float().sum(0)  # [L, E]
    share = mask / mask.sum(-1, keepdim=True)
    cum = share.sort(-1, descending=True).values.cumsum(-1)
    return [round(((c < 0.9).sum().item() + 1) / share.shape[-1], 3) for c in cum]


def cmd_routing(args) -> dict:
    """The routing statistics of the evaluation trace beside the embedded model's and the published figures."""
    from moeflow import MoEModel
    from moeflow.tools.record import record_trace
    from moeflow.trace.stats import routing_stats
    from scripts.policy_table import MODEL as EMBEDDED

    _, ev = traces(args.model, args.out, args.new_tokens)
    emb_model = MoEModel.from_pretrained(EMBEDDED, device="cpu")
    emb = record_trace(emb_model, prompts(emb_model)[1], args.new_tokens, progress=False)
    stats = {"routing": {**routing_stats(ev), "coverage90": coverage90(ev)},
             "embedded": {**routing_stats(emb), "coverage90": coverage90(emb)}}
    r, e = stats["routing"], stats["embedded"]

    def rng(v: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
        return f"{min(v) * scale:{fmt}}–{max(v) * scale:{fmt}}"

    ratio = lambda st: [x / st["consecutive_reuse_uniform"] for x in st["consecutive_reuse"]]  # noqa: E731
    lines = [f"| statistic (per layer, range over layers) | embedded (4 × 8, top-2) | routing model "
             f"({r['layers']} × {r['experts']}, top-{r['top_k']}) | published |", "| --- | --- | --- | --- |",
             f"| busiest expert's load / mean load | {rng(e['max_over_mean_share'])} | "
             f"{rng(r['max_over_mean_share'])} | Qwen3-30B-A3B: top expert 4.3 % / 6.3 % of a layer's routing "
             "(5.5× / 8.1× the mean of 128; diverse / Python-only text) [q] |",
             f"| usage entropy / log E | {rng(e['usage_entropy_fraction'], fmt='.3f')} | "
             f"{rng(r['usage_entropy_fraction'], fmt='.3f')} | Qwen3-30B-A3B: 0.889 / 0.846 [q] |",
             f"| share of experts carrying 90 % of the routing | {rng(e['coverage90'])} | {rng(r['coverage90'])} "
             "| Qwen3-30B-A3B: 0.51 / 0.45 [q] |",
             f"| experts shared with the previous token, × random (k / E) | {rng(ratio(e))} | {rng(ratio(r))} | "
             "Mixtral-8x7B: first choice repeated 1.1–1.2× random at layer 0, 1.9–2.3× at layer 15, 1.6–2.1× at "
             "layer 31; first-or-second 1.0–1.1× / 1.3–1.4× / 1.0–1.2× [m] |",
             f"| recall of layer l+1 from layer l's experts (co-occurrence, in-sample) | "
             f"{rng(e['affinity_recall'])} | {rng(r['affinity_recall'])} | DuoServe Fig. 2: Mixtral's layer 0→1 "
             "affinity visible, no figure |",
             f"| recall of layer l+1's k most popular experts | {rng(e['popularity_recall'])} | "
             f"{rng(r['popularity_recall'])} | – |"]
    md = "\n".join(lines)
    print(md)
    return {**stats, "markdown": md}


def cmd_sim(args, batch: int = 1) -> dict:
    """Every policy x budget (x the gate) on each profile; ``batch`` > 1: the first ``batch`` evaluation sequences
    prefilled in one pass and decoded together (``simulate(batch=)``), beside the CPU runtime's batch8 counts."""
    from moeflow.offload.policies import POLICY_TABLE, register_policy, unregister_policy
    from moeflow.sim import get_profile, simulate
    from moeflow.sim.simulator import load_gates

    _, ev = traces(args.model, args.out, args.new_tokens)
    gates = load_gates(args.model, ev.num_layers)
    total = ev.num_layers * ev.num_experts
    budgets = [round(total * f) for f in args.fractions]
    sequences = args.sim_sequences if batch == 1 else batch
    measured = _runtime_batch8(args.out, args.model) if batch == 8 else {}
    rows, lines = [], []
    for prof_name in args.profiles:
        profile = dataclasses.replace(get_profile(prof_name), num_layers=None, num_experts=None, top_k=None)
        head = ("| slots | policy | gate | hit decode | ready hit decode | hit prefill | decode MB / token | "
                "prefill MB / token | decode ms / token | TTFT ms | useful prefetches | gated |")
        if batch > 1:
            head = head.replace("decode ms / token |", "decode ms / token | decode pass ms |")
            head += " runtime: hit decode | runtime: decode experts / token | sim: decode experts / token |"
        lines += [f"\n**{prof_name}**\n", head, "|" + "---|" * head[1:].count("|")]
        for slots in budgets:
            for policy in args.policies:
                for gate in ((False, True) if policy in PREDICTIVE else (False,)):
                    name = policy
                    if gate:
                        spec = POLICY_TABLE[policy]
                        name = f"{policy}+gate"
                        register_policy(dataclasses.replace(spec, name=name, mechanisms=dataclasses.replace(
                            spec.mechanisms, prefetch_gate=True)))
                    try:
                        res = simulate(ev, name, slots, profile, gates=gates, timeline=False,
                                       predictor_dir=args.model, max_sequences=sequences, batch=batch)
                    finally:
                        if gate:
                            unregister_policy(name)
                    r = {"profile": prof_name, "slots": slots, "policy": policy, "gate": gate, **res.as_dict()}
                    r["decode_bytes_per_token"] = res.decode_bytes_h2d / max(res.decode_generated_tokens, 1)
                    r["prefill_bytes_per_token"] = res.prefill_bytes_h2d / max(res.prefill_tokens, 1)
                    r["decode_ms_per_token"] = (res.time_per_generated_token_s or 0.0) * 1e3
                    rows.append(r)
                    useful = res.useful_prefetches / res.prefetches if res.prefetches else None
                    line = (f"| {slots} | {policy} | {'on' if gate else '–'} | {_pct(res.decode_hit_rate)} | "
                            f"{_pct(res.decode_ready_hit_rate)} | {_pct(res.prefill_hit_rate)} | "
                            f"{r['decode_bytes_per_token'] / 1e6:.0f} | "
                            f"{r['prefill_bytes_per_token'] / 1e6:.0f} | {_ms(res.time_per_generated_token_s)} | ")
                    if batch > 1:
                        line += f"{_ms(res.tpot_s)} | "
                    line += f"{_ms(res.ttft_s)} | {_pct(useful)} | {res.gated_prefetches} |"
                    if batch > 1:
                        m = measured.get((slots, policy, gate))
                        sim_experts = r["decode_bytes_per_token"] / profile.expert_bytes
                        r["runtime"] = m
                        line += (f" {_pct(m['hit']) if m else '–'} | {f'{m[chr(101)]:.2f}' if m else '–'} | "
                                 f"{sim_experts:.2f} |")
                    lines.append(line)
                    print(lines[-1], flush=True)
    md = "\n".join(lines)
    print(md)
    return {"rows": rows, "budgets": budgets, "batch": batch, "sequences": sequences, "markdown": md}


def _runtime_batch8(out: Path, model_path: Path) -> dict:
    """The CPU runtime's batch-8 decode hit rate and experts per token per (slots, policy, gate), from ``batch8``'s
    JSON under ``out`` (empty when it was not run)."""
    path = out / "batch8.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    if any(r.get("expert_bytes") is None for r in rows):  # (written before batch8 kept it): the model's own
        from moeflow import MoEModel, OffloadConfig

        model = MoEModel.from_pretrained(model_path, device="cpu", kernels="torch",
                                         offload=OffloadConfig(policy="lru", gpu_expert_slots=8, transport="sync"))
        nbytes = model.experts.fmt.nbytes
        model.experts.close()
    got = {}
    for row in rows:
        d = row["decode"]
        got[row["slots"], row["policy"], row["gate"]] = {
            "hit": d["hits"] / max(d["hits"] + d["misses"], 1),
            "e": d["bytes_h2d"] / max(d["tokens"], 1) / (row.get("expert_bytes") or nbytes)}
    return got


def cmd_finemoe_store(args) -> dict:
    """FineMoE's Expert Map Store capacity against its recall and the simulator's decode hit rate (192 slots)."""
    import shutil

    from moeflow.offload.predictors import evaluate_held_out, train_predictor
    from moeflow.sim import get_profile, simulate

    train, ev = traces(args.model, args.out, args.new_tokens)
    profile = dataclasses.replace(get_profile("pcie4-24gb"), num_layers=None, num_experts=None, top_k=None)
    slots = round(ev.num_layers * ev.num_experts * 0.5)
    rows, lines = [], [f"| store capacity (maps) | maps stored | decode recall | hit decode | ready hit decode | "
                       f"decode MB / token ({slots} slots, `pcie4-24gb`) |", "|---|---|---|---|---|---|"]
    for cap in (30, 100, 300, 1000, 3000):
        ckpt = args.out / f"finemoe-c{cap}"
        (ckpt / "predictors").mkdir(parents=True, exist_ok=True)
        pred = train_predictor("finemoe", train, eval_fraction=0.1, seed=0, capacity=cap)
        pred.save(ckpt / "predictors" / "finemoe.pt")
        recall = evaluate_held_out(pred, ev, "decode").get("recall")
        res = simulate(ev, "finemoe", slots, profile, timeline=False, predictor_dir=ckpt,
                       max_sequences=args.sim_sequences)
        stored = pred.train_info.notes.get("stored_maps")
        rows.append({"capacity": cap, "stored": stored, "recall": recall, **res.as_dict()})
        lines.append(f"| {cap} | {stored} | {_pct(recall)} | {_pct(res.decode_hit_rate)} | "
                     f"{_pct(res.decode_ready_hit_rate)} | "
                     f"{res.decode_bytes_h2d / max(res.decode_steps, 1) / 1e6:.0f} |")
        print(lines[-1], flush=True)
        shutil.rmtree(ckpt)
    md = "\n".join(lines)
    print(md)
    return {"rows": rows, "markdown": md}


def serve_batch(model_path: Path, policy: str, slots: int | None, gate: bool, ids, mask, new_tokens: int) -> dict:
    from moeflow import MoEModel, OffloadConfig

    cfg = (OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync",
                         policy_options={"prefetch_gate": True} if gate else None))
    model = MoEModel.from_pretrained(model_path, device="cpu", offload=cfg, kernels="torch")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    s = model.stats
    fmt = getattr(model.experts, "fmt", None)  # resident: no host store
    row = {"prefill": s.prefill.__dict__.copy(), "decode": s.decode.__dict__.copy(), "tokens": out.tolist(),
           "expert_bytes": fmt.nbytes if fmt is not None else None}
    close = getattr(model.experts, "close", None)
    if close is not None:
        close()
    return row


def routed_experts(model) -> int:
    """Routed experts in the whole model, the budgets' 100%: MoE layers x experts per layer, from the family (its
    config's field: Mixtral's ``num_local_experts``, Qwen's ``num_experts``, DeepSeek's ``n_routed_experts``)."""
    return len(model.family.moe_layers) * model.family.num_experts


def cmd_batch8(args) -> dict:
    from moeflow import MoEModel

    model = MoEModel.from_pretrained(args.model, device="cpu")
    ev = prompts(model)[1][:8]
    width = max(map(len, ev))
    ids, mask = torch.zeros((len(ev), width), dtype=torch.long), torch.zeros((len(ev), width), dtype=torch.long)
    for i, p in enumerate(ev):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    total = routed_experts(model)
    budgets = [round(total * f) for f in args.fractions]
    ref = serve_batch(args.model, "resident", None, False, ids, mask, args.batch_tokens)
    rows, lines = [], ["| slots | policy | gate | hit decode | hit prefill | decode experts / token | "
                       "prefill experts / token | useful prefetches | gated guesses | = resident |",
                       "|---|---|---|---|---|---|---|---|---|---|"]
    for slots in budgets:
        for policy in args.policies:
            for gate in ((False, True) if policy in PREDICTIVE else (False,)):
                r = serve_batch(args.model, policy, slots, gate, ids, mask, args.batch_tokens)
                d, p = r["decode"], r["prefill"]
                nb = r["expert_bytes"]
                row = {"slots": slots, "policy": policy, "gate": gate, "prefill": p, "decode": d, "expert_bytes": nb,
                       "same_tokens": r["tokens"] == ref["tokens"]}
                rows.append(row)
                hit = lambda st: st["hits"] / max(st["hits"] + st["misses"], 1)  # noqa: E731
                useful = d["useful_prefetches"] / d["prefetches"] if d["prefetches"] else None
                lines.append(f"| {slots} | {policy} | {'on' if gate else '–'} | {_pct(hit(d))} | {_pct(hit(p))} | "
                             f"{d['bytes_h2d'] / max(d['tokens'], 1) / nb:.2f} | "
                             f"{p['bytes_h2d'] / max(p['tokens'], 1) / nb:.2f} | {_pct(useful)} | "
                             f"{d['gated_prefetches']} | "
                             f"{'yes' if row['same_tokens'] else 'NO'} |")
                print(lines[-1], flush=True)
    md = "\n".join(lines)
    print(md)
    return {"rows": rows, "budgets": budgets, "markdown": md}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=["predictors", "headline", "sim", "sim8", "batch8", "routing", "finemoe-store"])
    p.add_argument("--model", type=Path, default=ROOT / "build" / "routing-qwen3moe")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "papers-tables")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per traced prompt")
    p.add_argument("--sim-sequences", type=int, default=6, help="evaluation sequences the simulator replays")
    p.add_argument("--batch-tokens", type=int, default=16, help="greedy tokens of the batch-8 runs")
    p.add_argument("--max-seconds", type=float, default=90.0, help="training time per learned predictor")
    p.add_argument("--kinds", type=lambda s: s.split(","), default=KINDS, help="predictors: the kinds to train")
    p.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75],
                   help="slot budgets as fractions of every expert")
    p.add_argument("--profiles", type=lambda s: s.split(","), default=PROFILES)
    p.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    before = machine()
    result = {"predictors": cmd_predictors, "headline": cmd_headline, "sim": cmd_sim, "batch8": cmd_batch8,
              "sim8": lambda a: cmd_sim(a, batch=8),
              "routing": cmd_routing, "finemoe-store": cmd_finemoe_store}[
        args.table](args)
    result.update(machine=before, machine_after=machine(), seconds=round(time.perf_counter() - start, 1),
                  model=str(args.model), args={k: str(v) for k, v in vars(args).items()})
    report = args.model / "training_report.json"
    if report.exists():
        rep = json.loads(report.read_text())
        result["model_steps"] = rep.get("steps", rep.get("step"))
    (args.out / f"{args.table}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{result['seconds']} s; {before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
