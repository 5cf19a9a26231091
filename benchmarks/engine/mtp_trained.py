"""MTP speculation on the corpus-trained DeepSeek-V3-shaped model (scripts/train_mtp_model.py, issue 40): draft
acceptance at k = 1, 2, 3; expert bytes moved per generated token with and without speculation, offloaded at 25 %
and 50 % of the main model's experts (the MTP layer's experts share the slots) under lru and one predictive policy
(mixtral-offloading: the next layer's router applied to this layer's input), measured by the engine on the CPU; and
the simulator's price of the same runs (moeflow/sim/speculation.py: the recorded passes through the real scheduler
on virtual time) on the PCIe 4 24 GB, DeepSeek-V3 PCIe 4 24 GB and H100 PCIe 5 profiles' costs, also without the
MTP passes (``verify_only_*``: the drafts as if free, the limit of a model with many more MoE layers than MTP
layers: DeepSeek-V3 has 58 to 1, this one 3 to 1). Every speculative
run's tokens are asserted equal to plain greedy's. Prompts: windows of the training corpus's held-out split.

    python -m scripts.train_mtp_model --minutes 35 --out build/mtp-deepseekv3
    python -m benchmarks.engine.mtp_trained --model build/mtp-deepseekv3 --out benchmarks/results/mtp/<name>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from moeflow import MoEModel, OffloadConfig
from moeflow.sim.profile import get_profile
from moeflow.sim.speculation import price, record_passes

POLICIES = ("lru", "mixtral-offloading")
FRACTIONS = (0.25, 0.5)
PROFILES = ("pcie4-24gb", "deepseek-v3-pcie4-24gb", "h100-pcie5")


def heldout_prompts(n: int, length: int) -> list[torch.Tensor]:
    """``n`` windows of ``length`` bytes spread evenly over the held-out split of scripts/tiny_corpus.py."""
    from scripts.tiny_corpus import collect_corpus, split_corpus

    held = split_corpus(collect_corpus()[0])[1]
    step = (len(held) - length) // n
    return [torch.tensor(list(held[i * step: i * step + length]), dtype=torch.long) for i in range(n)]


def engine_run(path: Path, prompts, new: int, policy: str, slots: int, k: int | None) -> dict:
    """The engine offloaded on the CPU: decode bytes, tokens decoded after the first, outputs, wall seconds."""
    model = MoEModel.from_pretrained(path, mtp=k is not None,
                                     offload=OffloadConfig(policy=policy, gpu_expert_slots=slots))
    out = dict(bytes=0, decoded=0, drafted=0, accepted=0, seconds=0.0, outs=[])
    try:
        for ids in prompts:
            model.stats.reset()
            start = time.perf_counter()
            out["outs"].append(model.generate(ids[None], max_new_tokens=new, do_sample=False, eos_token_id=[],
                                              num_speculative_tokens=k))
            out["seconds"] += time.perf_counter() - start
            out["bytes"] += model.stats.decode.bytes_h2d
            out["decoded"] += new - 1
            out["drafted"] += model.stats.draft_tokens
            out["accepted"] += model.stats.accepted_tokens
    finally:
        model.experts.close()
    return out


def r4(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("build/mtp-deepseekv3"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    new = args.new_tokens
    plain = record_passes(MoEModel.from_pretrained(args.model), prompts, new)
    main_experts = (plain.trace.num_layers) * plain.trace.num_experts
    runs, acceptance = {}, []
    spec_model = MoEModel.from_pretrained(args.model, mtp=True)
    for k in args.ks:
        runs[k] = record_passes(spec_model, prompts, new, k)
        same = all(torch.equal(a, b) for a, b in zip(plain.outputs, runs[k].outputs, strict=True))
        assert same, f"k={k}: speculative tokens differ from plain greedy"
        verify = sum(1 for steps in runs[k].passes for p in steps if p.phase == 1 and p.yields > 0)
        row = dict(k=k, tokens_equal=same, drafted=runs[k].drafted, accepted=runs[k].accepted,
                   acceptance=runs[k].acceptance, tokens_per_verify_pass=len(prompts) * (new - 1) / verify)
        acceptance.append(r4(row))
        print(json.dumps(acceptance[-1]), flush=True)
    engine_rows = []
    for policy in args.policies:
        for frac in FRACTIONS:
            slots = round(frac * main_experts)
            base = engine_run(args.model, prompts, new, policy, slots, None)
            for a, b in zip(base["outs"], plain.outputs, strict=True):
                assert torch.equal(a, b), f"{policy} {slots} slots: plain tokens differ from resident greedy"
            for k in args.ks:
                spec = engine_run(args.model, prompts, new, policy, slots, k)
                same = all(torch.equal(a, b) for a, b in zip(base["outs"], spec["outs"], strict=True))
                assert same, f"{policy} {slots} slots k={k}: speculative tokens differ from plain greedy"
                row = dict(policy=policy, experts_fraction=frac, slots=slots, k=k, tokens_equal=same,
                           acceptance=spec["accepted"] / max(spec["drafted"], 1),
                           plain_bytes_per_token=base["bytes"] / base["decoded"],
                           spec_bytes_per_token=spec["bytes"] / spec["decoded"],
                           plain_tok_s=base["decoded"] / base["seconds"], spec_tok_s=spec["decoded"] / spec["seconds"])
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
                for k in args.ks:
                    sp = price(runs[k], policy, slots, profile)
                    free = price(runs[k], policy, slots, profile, mtp_passes=False)  # the drafts as if free
                    row = dict(profile=name, policy=policy, experts_fraction=frac, slots=slots, k=k,
                               acceptance=runs[k].acceptance,
                               plain_bytes_per_token=base["bytes_per_token"],
                               spec_bytes_per_token=sp["bytes_per_token"],
                               bytes_ratio=sp["bytes_per_token"] / base["bytes_per_token"],
                               plain_ms_per_token=1e3 * base["time_per_token_s"],
                               spec_ms_per_token=1e3 * sp["time_per_token_s"],
                               time_ratio=sp["time_per_token_s"] / base["time_per_token_s"],
                               plain_hit_rate=base["decode_hit_rate"], spec_hit_rate=sp["decode_hit_rate"],
                               verify_only_bytes_ratio=free["bytes_per_token"] / base["bytes_per_token"],
                               verify_only_time_ratio=free["time_per_token_s"] / base["time_per_token_s"])
                    sim_rows.append(r4(row))
                    print(json.dumps(sim_rows[-1]), flush=True)
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    cpu += " (" + " ".join(f for f in flags if f.startswith("avx512")) + ")"
    training = args.model / "training_report.json"
    report = dict(model=str(args.model), config=json.loads((args.model / "config.json").read_text()),
                  training=json.loads(training.read_text()) if training.is_file() else None,
                  prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=new, main_experts=main_experts,
                  cpu=cpu, threads=1, uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  acceptance=acceptance, engine=engine_rows, simulated=sim_rows)
    if report["training"] is not None:
        report["training"].pop("log", None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
