"""Every scheduling decision of the no-op-kernel driver, to show a host-cost change leaves the policies' choices alone.

For each policy and slot count (every expert, half, a quarter) the driver of ``host/overhead.py`` (seeded
routing, one decode token per step, expert kernels a no-op) runs 48 steps and logs every copy submitted (layer,
expert, slot, priority), every prefetch list handed to the backend, the (key, state) of every slot after every
layer, and the decode stats. Run it on two trees and compare:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.host.decision_log --out after.json
    python -m benchmarks.host.decision_log --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.host.overhead import POLICIES, _backend, noop_steps


@torch.inference_mode()
def decision_log(model, policy: str, slots: int, steps: int) -> list:
    log: list = []
    backend = _backend(model, policy, slots, noop=True)
    submit, prefetch = backend.engine.submit, backend.loads.prefetch_guesses

    def logged_submit(layer, expert, slot, high=False, **kw):
        log.append(("submit", layer, expert, slot, high))
        return submit(layer, expert, slot, high=high, **kw)

    def logged_prefetch(target, ids, layer, st):
        log.append(("prefetch", target, list(ids), layer))
        return prefetch(target, ids, layer, st)

    backend.engine.submit, backend.loads.prefetch_guesses = logged_submit, logged_prefetch
    model.stats.reset()
    model.stats.set_phase("decode")
    for info, layers in noop_steps(model, steps, seed=slots):
        backend.begin_step(info)
        for layer, args in enumerate(layers):
            backend.forward(layer, *args)
            log.append(("slots", [(s.key, s.state.name) for s in backend.cache.slots]))
    d = model.stats.decode
    log.append(("stats", d.hits, d.misses, d.prefetches, d.inflight_hits))
    backend.close()
    return log


def compare(before: Path, after: Path) -> bool:
    a, b = (json.loads(p.read_text()) for p in (before, after))
    same = True
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            print(f"{key:28s} identical ({len(y)} entries)")
            continue
        same = False
        first = next((i for i, (p, q) in enumerate(zip(x or [], y or [], strict=False)) if p != q), None)
        print(f"{key:28s} DIFFERS at entry {first}: {x[first] if first is not None else len(x or [])} vs "
              f"{y[first] if first is not None else len(y or [])}")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    from moeflow import MoEOffloadedMixtral, OffloadConfig
    from moeflow.cli import embedded_model_path

    torch.set_num_threads(1)
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch",
                                                offload=OffloadConfig(policy="lru", transport="sync"))
    total = model.experts.num_layers * model.experts.num_experts
    out = {}
    for policy in args.policies.split(","):
        for slots in (total, total // 2, total // 4):
            out[f"{policy}/{slots}"] = decision_log(model, policy, slots, args.steps)
            print(policy, slots, len(out[f"{policy}/{slots}"]), flush=True)
    model.close()
    if args.out:
        args.out.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
