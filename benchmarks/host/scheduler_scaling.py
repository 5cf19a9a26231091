"""The scheduler's bookkeeping as the pool grows (issue 14): host microseconds per slot allocation (an eviction)
for every eviction policy, and the predictive policies' per-layer host work, at Mixtral's shape (32 layers x 8
experts, 230 slots) and at Qwen3-30B's (48 x 128 = 6,144 experts, ~3,000 slots). CPU only, no model.

* ``evict``: an :class:`~moeflow.offload.cache.ExpertCache` filled with ready experts; each timed call is one
  ``allocate`` of a missing expert, so the policy picks a victim among ``slots`` candidates (lru, lfu, static,
  FineMoE's ``PriorityEviction(LFU, p * freq)`` over its score table, ExpertFlow's PLEC order with a plan).
* ``finemoe``: one decode layer of the FineMoE predictor in the runtime's calls (``observe`` with the layer's
  routing: the trajectory search over a full Expert Map Store of ``capacity`` maps; ``runtime_proposals``: the
  delta selection and ranking), per layer.

    PYTHONPATH=$PWD python -m benchmarks.host.scheduler_scaling --out benchmarks/results/host_overhead/scaling.json

Medians and 10th percentiles of per-call times (the machine is shared; p10 is the intrinsic cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from moeflow.offload.cache import ExpertCache
from moeflow.offload.eviction import LFU, PriorityEviction, make_eviction
from moeflow.offload.policies.expertflow import PLECEviction, PLECState
from moeflow.offload.policies.finemoe import FineMoERuntime
from moeflow.offload.policies.finemoe.predictor import FineMoEPredictor
from moeflow.offload.predictors.base import ModelShape

SHAPES = {"mixtral": (32, 8, 2, 230), "qwen3-30b": (48, 128, 8, 3000)}  # layers, experts, top-k, slots


class _Task:
    """A finished load (the cache only stores it until mark_ready)."""


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs) * 1e6, "p10_us": xs[len(xs) // 10] * 1e6, "calls": len(xs)}


def _finemoe(L: int, E: int, k: int, capacity: int, seed: int) -> FineMoEPredictor:
    g = torch.Generator().manual_seed(seed)
    pred = FineMoEPredictor(ModelShape(L, E, k, 64), distance=3, capacity=capacity)
    pred.runtime_mode = True
    pred.store.add(torch.softmax(torch.randn(capacity, L, E, generator=g), -1), torch.randn(capacity, 64, generator=g))
    pred.freq += torch.randint(0, 50, (L, E), generator=g).float()
    return pred


def _policy(name: str, L: int, E: int, k: int, slots: int, seed: int):
    rng = random.Random(seed)
    if name == "finemoe":
        rt = FineMoERuntime(_finemoe(L, E, k, 64, seed))
        rt.predictor.guidance = torch.rand(L, E, generator=torch.Generator().manual_seed(seed))
        return PriorityEviction(LFU(), rt.eviction_score, rt.eviction_table), None
    if name == "plec":
        state = PLECState(L, E)
        state.new_pass({layer: rng.sample(range(E), k) for layer in range(L)})
        return PLECEviction(state), state
    return make_eviction(name, n_slots=slots, ring_slots=slots // 2), None


def evict_us(name: str, L: int, E: int, k: int, slots: int, allocs: int, seed: int = 0) -> dict:
    """Per-allocation host time with a full pool of ready, unused experts (each allocation evicts one)."""
    rng = random.Random(seed)
    policy, state = _policy(name, L, E, k, slots, seed)
    cache = ExpertCache(slots, policy, key_space=(L, E))
    keys = [(layer, e) for layer in range(L) for e in range(E)]
    rng.shuffle(keys)
    for key in keys[:slots]:
        policy.access(key)
        slot = cache.allocate(key, 0)
        cache.start_load(slot, _Task(), prefetched=False)
        cache.mark_ready(slot)
    if name == "static":
        policy.on_phase("decode")
    times = []
    for _ in range(allocs):
        key = rng.choice(keys)
        while cache.lookup(key) is not None:
            key = rng.choice(keys)
        layer_now = key[0]
        if state is not None:
            state.layer_now = layer_now
        policy.access(key)
        t0 = time.perf_counter()
        slot = cache.allocate(key, layer_now)
        times.append(time.perf_counter() - t0)
        cache.start_load(slot, _Task(), prefetched=False)
        cache.mark_ready(slot)
    return _stats(times)


def finemoe_layer_us(L: int, E: int, k: int, capacity: int, steps: int, seed: int = 0) -> dict:
    """FineMoE's per-layer predictor work in decode (observe + runtime_proposals), full store."""
    g = torch.Generator().manual_seed(seed + 1)
    pred = _finemoe(L, E, k, capacity, seed)
    times = []
    for _ in range(steps):
        pred.begin_iteration(torch.randn(1, 64, generator=g))
        for layer in range(L):
            probs = torch.softmax(torch.randn(1, E, generator=g), -1)
            top = torch.topk(probs, k).indices
            t0 = time.perf_counter()
            pred.observe(layer, None, probs, top)
            pred.runtime_proposals(layer)
            times.append(time.perf_counter() - t0)
        pred.end_iteration()  # replaces the most redundant stored map (the store stays full)
    return _stats(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--allocs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=1000, help="FineMoE Expert Map Store capacity (paper: 1K)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict = {"load_before": os.getloadavg(), "evict": {}, "finemoe_layer": {}}
    for shape, (L, E, k, slots) in SHAPES.items():
        for name in ("lru", "lfu", "static", "finemoe", "plec"):
            r = evict_us(name, L, E, k, slots, args.allocs)
            result["evict"][f"{name}/{shape}"] = r
            print(f"evict {name:8s} {shape:10s} {slots:5d} slots: {r['median_us']:8.1f} us (p10 {r['p10_us']:7.1f})",
                  flush=True)
        r = finemoe_layer_us(L, E, k, args.capacity, args.steps)
        result["finemoe_layer"][shape] = r
        print(f"finemoe layer {shape:10s} {args.capacity} maps: {r['median_us']:8.1f} us (p10 {r['p10_us']:7.1f})",
              flush=True)
    result["load_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
