"""The draft-informed prefetch limited to the first MoE layers (issue 40): is the whole-pass prefetch's loss its
depth? On the trained model (scripts/train_mtp_model.py), k = 1, lru at 25 % / 50 % of the main model's experts,
the simulator's pcie4-24gb costs: each verify pass's prefetch requests kept for MoE layers < d only, for the
``mtp-only`` proxy and for the exact prediction (the verify pass's own experts; the bound of any proxy); bytes and
time per generated token over plain decode's, with and without the MTP passes (the drafts as if free).

    python -m benchmarks.engine.mtp_prefetch_layers --out benchmarks/results/mtp/<name>.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.engine.mtp_prefetch import with_exact_prefetch
from benchmarks.engine.mtp_trained import heldout_prompts, r4
from moeflow import MoEModel
from moeflow.sim.profile import get_profile
from moeflow.sim.speculation import RecordedRun, price, record_passes


def first_layers(run: RecordedRun, depth: int | None) -> RecordedRun:
    """``run`` with each pass's prefetch requests for MoE layers < ``depth`` only (None: all of them)."""
    if depth is None:
        return run
    return replace(run, passes=[[replace(p, prefetch=tuple(x for x in p.prefetch if x[0] < depth)) for p in steps]
                                for steps in run.passes])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("build/mtp-deepseekv3"))
    ap.add_argument("--profile", default="pcie4-24gb")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(6, 64)
    plain = record_passes(MoEModel.from_pretrained(args.model), prompts, 48)
    model = MoEModel.from_pretrained(args.model, mtp=True)
    runs = {"mtp-only": record_passes(model, prompts, 48, 1, mtp_prefetch="mtp-only"),
            "exact": with_exact_prefetch(record_passes(model, prompts, 48, 1))}
    profile, rows = get_profile(args.profile), []
    main_experts = plain.trace.num_layers * plain.trace.num_experts
    for frac in (0.25, 0.5):
        slots = round(frac * main_experts)
        base = price(plain, "lru", slots, profile)
        for name, run in runs.items():
            for depth in (None, 1, 2):
                cut = first_layers(run, depth)
                sp, free = price(cut, "lru", slots, profile), price(cut, "lru", slots, profile, mtp_passes=False)
                rows.append(r4(dict(experts_fraction=frac, slots=slots, prefetch=name, layers=depth or "all",
                                    bytes_ratio=sp["bytes_per_token"] / base["bytes_per_token"],
                                    time_ratio=sp["time_per_token_s"] / base["time_per_token_s"],
                                    verify_only_bytes_ratio=free["bytes_per_token"] / base["bytes_per_token"],
                                    verify_only_time_ratio=free["time_per_token_s"] / base["time_per_token_s"])))
                print(json.dumps(rows[-1]), flush=True)
    report = dict(model=str(args.model), profile=args.profile, policy="lru", k=1, prompts=6, new_tokens=48,
                  uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), rows=rows)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
