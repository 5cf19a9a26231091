"""Simulated time per decoded token against host memory for DeepSeek-V3-, Qwen3-235B- and gpt-oss-120b-shaped
models (``moeflow simulate``'s disk tier, docs/disk.md).

Traces are synthetic (``moeflow.trace.synthetic.synthesize_trace``: clustered routing with per-layer drift) of
each model's MoE shape; expert sizes are their 4-bit sizes. The hardware is an assumed profile, not a
measurement: PCIe 5 host->device at 50 GB/s, an NVMe disk at 7 GB/s with 80 us latency, and the compute times
below. Device slots: what 16 GiB of expert memory holds. Policies: ``lru`` (demand loads only) and ``oracle``
(perfect prefetch one layer ahead: the bound a predictor can reach).

    python -m benchmarks.disk.sim_tiers --out benchmarks/results/disk/sim_disk_tiers.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moeflow.sim.profile import custom_profile
from moeflow.sim.simulator import simulate
from moeflow.trace.synthetic import synthesize_trace

GiB = 2**30
# name: (MoE layers, experts, top-k, MiB per 4-bit expert, host budgets in GiB of experts)
MODELS = {
    "deepseek-v3": (58, 256, 8, 3 * 7168 * 2048 / 2 * 1.03 / 2**20, (64, 128, 256)),
    "qwen3-235b-a22b": (94, 128, 8, 3 * 4096 * 1536 / 2 * 1.03 / 2**20, (32, 64)),
    "gpt-oss-120b": (36, 128, 4, 3 * 2880 * 2880 / 2 * 1.03 / 2**20, (16, 32)),
}
COSTS = dict(h2d_gbps=50.0, latency_us=10.0, layer_ms=0.08, expert_ms=0.015, expert_ms_per_token=0.0005,
             head_ms=0.3, sched_ms=0.05, disk_gbps=7.0, disk_latency_us=80.0)
GPU_EXPERT_GIB = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=9)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (layers, experts, k, mib, budgets) in MODELS.items():
        trace, _ = synthesize_trace(num_layers=layers, num_experts=experts, top_k=k, hidden_size=64, sequences=1,
                                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=0)
        profile = custom_profile(expert_mb=mib, name=f"assumed-{name}", **COSTS)
        slots = int(GPU_EXPERT_GIB * GiB // profile.expert_bytes)
        total = layers * experts
        for policy in ("lru", "oracle"):
            for host_gib in (*budgets, None):
                host = None if host_gib is None else int(host_gib * GiB // profile.expert_bytes)
                t0 = time.perf_counter()
                r = simulate(trace, policy, slots, profile, timeline=False, host_experts=host)
                row = {"model": name, "policy": policy, "slots": r.slots, "total_experts": total,
                       "model_gib": round(total * profile.expert_bytes / GiB, 1),
                       "host_gib": host_gib, "host_experts": r.host_experts, "tpot_ms": round(r.tpot_s * 1e3, 2),
                       "decode_bound_ms": round(r.decode_bound_s * 1e3, 2),
                       "disk_gib_per_new_token_incl_prefill": round(r.disk_bytes / GiB / max(1, r.decode_steps + 1), 3),
                       "sim_s": round(time.perf_counter() - t0, 1)}
                print(row, flush=True)
                rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"profile": COSTS, "gpu_expert_gib": GPU_EXPERT_GIB,
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
