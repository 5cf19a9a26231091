"""MTP speculation's draft-informed prefetch on the corpus-trained DeepSeek-V3-shaped model (issue 40, point 3).

Per proxy (``generate(mtp_prefetch=...)``, moeflow/engine/mtp_prefetch.py) and k: how well each main MoE layer's
router applied to the proxy predicts the verify pass's experts (recall: the verify passes' (layer, expert) pairs
the prediction named; precision: the predicted pairs the passes used), from the recorded passes; the engine's bytes
moved per generated token on the CPU offloaded at 25 % / 50 % of the main model's experts with and without the
prefetch, plain decode beside (the CPU transport is synchronous: every queued copy is made); and the simulator's
price of the same runs (recorded passes replayed through the real scheduler on virtual time, the prefetch requests
queued before each verify pass as the engine queues them) per profile, policy and budget, also with the MTP passes
dropped (the drafts as if free), and with an exact prediction (``exact``: each verify pass's own experts
requested before it, the bound of any proxy). Also the routing locality of the plain run (the union of w
consecutive tokens' experts per layer, in units of top-k) that decides what speculation can save. Every
speculative run's tokens are asserted equal to plain greedy's.

    python -m scripts.train_mtp_model --steps 1501 --out build/mtp-deepseekv3
    python -m benchmarks.engine.mtp_prefetch --model build/mtp-deepseekv3 --out benchmarks/results/mtp/<name>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.engine.mtp_trained import heldout_prompts, r4
from moeflow import MoEModel, OffloadConfig
from moeflow.engine.mtp_prefetch import PROXIES
from moeflow.offload.policies import POLICY_TABLE, register_policy, unregister_policy
from moeflow.sim.profile import get_profile
from moeflow.sim.speculation import RecordedRun, price, record_passes
from moeflow.trace import DECODE

FRACTIONS = (0.25, 0.5)


def proxy_accuracy(run: RecordedRun) -> dict:
    """Recall / precision of the recorded prefetch requests against the verify passes' routing (main layers)."""
    predicted = used = both = 0
    for steps in run.passes:
        for p in steps:
            if p.phase != DECODE or p.yields == 0:
                continue
            want = {(layer, int(e)) for layer in range(run.main_layers)
                    for e in run.trace.topk_ids[p.rows, layer].reshape(-1).tolist()}
            got = {(layer, e) for layer, experts in p.prefetch for e in experts}
            predicted, used, both = predicted + len(got), used + len(want), both + len(got & want)
    return dict(predicted_pairs=predicted, needed_pairs=used, recall=both / used if used else None,
                precision=both / predicted if predicted else None)


def with_exact_prefetch(run: RecordedRun) -> RecordedRun:
    """``run`` with each verify pass's prefetch requests replaced by the experts the pass really used (per main MoE
    layer, most-used first): the bound of any draft-informed prediction (the simulator only: no engine makes it)."""
    passes = []
    for steps in run.passes:
        out = []
        for p in steps:
            if p.phase == DECODE and p.yields > 0:
                exact = []
                for layer in range(run.main_layers):
                    counts = torch.bincount(run.trace.topk_ids[p.rows, layer].reshape(-1).long())
                    order = torch.argsort(counts, descending=True, stable=True)
                    exact.append((layer, tuple(int(e) for e in order if counts[e] > 0)))
                p = replace(p, prefetch=tuple(exact))
            out.append(p)
        passes.append(out)
    return replace(run, passes=passes)


def locality(plain: RecordedRun, windows=(1, 2, 3, 4)) -> dict:
    """Per window w: the mean union of w consecutive decode tokens' experts per main layer, over top-k (w = 1: 1)."""
    k, out = plain.trace.top_k, {}
    for w in windows:
        sizes = []
        for steps in plain.passes:
            rows = [p.rows.start for p in steps if p.phase == DECODE]
            for i in range(len(rows) - w + 1):
                for layer in range(plain.main_layers):
                    ids = plain.trace.topk_ids[rows[i:i + w], layer].reshape(-1).tolist()
                    sizes.append(len(set(ids)) / k)
        out[w] = sum(sizes) / len(sizes)
    return out


def engine_run(path: Path, prompts, new: int, policy: str, slots: int, k: int | None, prefetch: str | None,
               gate: bool = False) -> dict:
    """The engine offloaded on the CPU (``gate``: the bandwidth-aware prefetch gate on, ``policy_options``)."""
    model = MoEModel.from_pretrained(path, mtp=k is not None, offload=OffloadConfig(
        policy=policy, gpu_expert_slots=slots, policy_options={"prefetch_gate": True} if gate else None))
    out = dict(bytes=0, decoded=0, outs=[], queued=0, queued_used=0, useful=0, timely=0, hits=0, misses=0)
    try:
        for ids in prompts:
            model.stats.reset()
            out["outs"].append(model.generate(ids[None], max_new_tokens=new, do_sample=False, eos_token_id=[],
                                              num_speculative_tokens=k, mtp_prefetch=prefetch))
            st, dp = model.stats.decode, model.stats.draft_prefetch
            out["bytes"] += st.bytes_h2d
            out["decoded"] += new - 1
            out["queued"] += dp.queued
            out["queued_used"] += dp.queued_used
            out["useful"] += st.useful_prefetches
            out["timely"] += st.timely_prefetches
            out["hits"] += st.hits
            out["misses"] += st.misses
    finally:
        model.experts.close()
    return out


@contextmanager
def gated(policy: str, gate: bool):
    """``policy``, or (``gate``) the same policy with the bandwidth-aware prefetch gate on, registered for the
    simulator under ``<policy>+gate`` while the block runs."""
    if not gate:
        yield policy
        return
    spec = POLICY_TABLE[policy]
    name = f"{policy}+gate"
    register_policy(dataclasses.replace(spec, name=name, mechanisms=dataclasses.replace(spec.mechanisms,
                                                                                        prefetch_gate=True)))
    try:
        yield name
    finally:
        unregister_policy(name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("build/mtp-deepseekv3"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--policies", nargs="+", default=["lru", "mixtral-offloading"])
    ap.add_argument("--profiles", nargs="+", default=["pcie4-24gb", "deepseek-v3-pcie4-24gb", "h100-pcie5"])
    ap.add_argument("--engine-proxy", default="mtp", help="the proxy the engine and simulator rows compare")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    new = args.new_tokens
    plain = record_passes(MoEModel.from_pretrained(args.model), prompts, new)
    main_experts = plain.trace.num_layers * plain.trace.num_experts
    spec_model = MoEModel.from_pretrained(args.model, mtp=True)
    runs: dict[tuple[int, str | None], RecordedRun] = {}
    accuracy = []
    for k in args.ks:
        for proxy in (None, *PROXIES):
            run = record_passes(spec_model, prompts, new, k, mtp_prefetch=proxy)
            assert all(torch.equal(a, b) for a, b in zip(plain.outputs, run.outputs, strict=True)), (k, proxy)
            runs[k, proxy] = run
            if proxy is None:
                runs[k, "exact"] = with_exact_prefetch(run)
            if proxy is not None:
                accuracy.append(r4(dict(k=k, proxy=proxy, acceptance=run.acceptance, **proxy_accuracy(run))))
                print(json.dumps(accuracy[-1]), flush=True)
    engine_rows = []
    for policy in args.policies:
        for frac in FRACTIONS:
            slots = round(frac * main_experts)
            base = engine_run(args.model, prompts, new, policy, slots, None, None)
            for k in args.ks:
                for proxy, gate in ((None, False), (args.engine_proxy, False), (args.engine_proxy, True)):
                    spec = engine_run(args.model, prompts, new, policy, slots, k, proxy, gate)
                    assert all(torch.equal(a, b) for a, b in zip(base["outs"], spec["outs"], strict=True))
                    row = dict(policy=policy, experts_fraction=frac, slots=slots, k=k, prefetch=proxy, gate=gate,
                               plain_bytes_per_token=base["bytes"] / base["decoded"],
                               spec_bytes_per_token=spec["bytes"] / spec["decoded"],
                               plain_hit_rate=base["hits"] / max(base["hits"] + base["misses"], 1),
                               spec_hit_rate=spec["hits"] / max(spec["hits"] + spec["misses"], 1),
                               queued=spec["queued"], queued_used=spec["queued_used"],
                               useful_prefetches=spec["useful"], timely_prefetches=spec["timely"])
                    row["bytes_ratio"] = row["spec_bytes_per_token"] / row["plain_bytes_per_token"]
                    engine_rows.append(r4(row))
                    print(json.dumps(engine_rows[-1]), flush=True)
    sim_rows = []
    for name in args.profiles:
        profile = get_profile(name)
        for policy in args.policies:
            for frac in FRACTIONS:
                slots = round(frac * main_experts)
                base = price(plain, policy, slots, profile)
                cases = [(k, proxy, False) for k in args.ks for proxy in (None, *PROXIES, "exact")]
                cases += [(k, args.engine_proxy, True) for k in args.ks]
                for k, proxy, gate in cases:
                    run = runs[k, proxy]
                    gates = policy == "mixtral-offloading"
                    with gated(policy, gate) as name_used:
                        sp = price(run, name_used, slots, profile, needs_gates=gates)
                        free = price(run, name_used, slots, profile, mtp_passes=False, needs_gates=gates)
                    row = dict(profile=name, policy=policy, experts_fraction=frac, slots=slots, k=k, prefetch=proxy,
                               gate=gate, acceptance=run.acceptance, plain_ms_per_token=1e3 * base["time_per_token_s"],
                               spec_ms_per_token=1e3 * sp["time_per_token_s"],
                               bytes_ratio=sp["bytes_per_token"] / base["bytes_per_token"],
                               time_ratio=sp["time_per_token_s"] / base["time_per_token_s"],
                               spec_hit_rate=sp["decode_hit_rate"],
                               verify_only_bytes_ratio=free["bytes_per_token"] / base["bytes_per_token"],
                               verify_only_time_ratio=free["time_per_token_s"] / base["time_per_token_s"])
                    sim_rows.append(r4(row))
                    print(json.dumps(sim_rows[-1]), flush=True)
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    cpu += " (" + " ".join(f for f in flags if f.startswith("avx512")) + ")"
    report = dict(model=str(args.model), prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=new,
                  main_experts=main_experts, cpu=cpu, threads=1,
                  uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  locality={str(w): round(v, 4) for w, v in locality(plain).items()},
                  tokens_per_verify_pass={str(k): round(len(prompts) * (new - 1) / sum(
                      1 for steps in runs[k, None].passes for p in steps if p.phase == DECODE and p.yields > 0), 4)
                      for k in args.ks},
                  accuracy=accuracy, engine=engine_rows, simulated=sim_rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
