"""Host cost of the offloading scheduler with many small experts (issue 16 item 3, issue 14 item 5), CPU.

A Qwen3-30B-A3B-shaped backend: 48 MoE layers x 128 experts, top-8, AWQ int4 experts of the real size (hidden
2048, intermediate 768, group 128: 2.34 MiB each), the real ``OffloadedExperts`` / cache / eviction / predictors /
``CopyEngine`` queue. What is not real comes through the Platform seam (``moeflow/offload/platform.py``):

* expert kernels: no-ops that charge the profile's expert time on the virtual compute stream;
* transport: the simulator's virtual-time copy stream (``moeflow.sim.engine.SimTransport``, ``qwen3-30b-pcie4-12gb``:
  25 GB/s, 10 us per copy), here with ``copy_batch`` (several copies, one completion handle) so a copy engine
  that batches can; one charged latency per copy either way; no byte moves, so the host store (14.1 GiB) and
  the slot pool are allocated but never touched;
* routing: a synthetic Qwen3-shaped trace (``moeflow.trace.synthetic.synthesize_trace``: skew, token locality,
  a residual stream), prompt then greedy decode rows.

Per decode step and MoE layer it reports: host us of ``backend.forward`` (median and mean over layers x steps,
wall clock, and the thread's CPU time, robust to the preemptions of a shared machine; the host never blocks on
real copies here, so this is the scheduler, the issuing of copies and the simulator's replay of the copy worker,
all on one thread), copies (``cudaMemcpyAsync`` on CUDA), events (copy completions + compute fences: one CUDA event
each), tasks (loads submitted), thread CPU us per ``ExpertCache.allocate`` call (median, mean, p99; a free slot or an
eviction) and predictor us per layer (observe
+ propose + begin_step / layers), hit rate and the virtual time per token. Each configuration runs under every
source tree given (``--tree before=DIR``: e.g. ``git archive 17ac1bd moeflow | tar -x -C DIR``), alternating
trees within each repeat, each run in its own process; the load average is recorded beside the numbers.

    PYTHONPATH=$PWD python -m benchmarks.host.many_experts --tree before=/tmp/main --tree after=. \\
        --out benchmarks/results/many_experts/many_experts.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# (policy, slots): lru / lfu for the plain cache at ~1000 and ~3000 slots (2.3 and 6.9 GiB of experts);
# finemoe (priority eviction + semantic predictor) and mixtral-offloading (gate speculation) as predictive ones
CONFIGS = (("lru", 1000), ("lru", 3000), ("lfu", 1000), ("lfu", 3000), ("mixtral-offloading", 1000),
           ("mixtral-offloading", 3000), ("finemoe", 1000), ("finemoe", 3000))
PROFILE = "qwen3-30b-pcie4-12gb"


# ------------------------------------------------------------------------------------------------ one run
def run_one(policy: str, slots: int, *, tokens: int, prompt: int, seed: int) -> dict:
    """One backend of ``policy`` with ``slots`` slots over a synthetic Qwen3-30B-shaped trace; its counters."""
    from moeflow.config import OffloadConfig
    from moeflow.kernels.formats import expert_format
    from moeflow.offload import create_expert_backend
    from moeflow.offload.platform import Platform
    from moeflow.offload.stats import Stats
    from moeflow.sim.engine import SimClock, SimCopyEngine, SimHostStore, SimTransport
    from moeflow.sim.profile import QWEN3_30B_A3B, get_profile
    from moeflow.trace.synthetic import gate_modules, synthesize_trace

    shape = QWEN3_30B_A3B
    L, E, k = shape["num_layers"], shape["num_experts"], shape["top_k"]
    fmt = expert_format(shape["hidden"], shape["intermediate"], "awq", torch.float16, group_size=128)
    prof = get_profile(PROFILE)
    trace, gates = synthesize_trace(num_layers=L, num_experts=E, top_k=k, hidden_size=64, sequences=1,
                                    prompt_len=prompt, new_tokens=tokens + 1, seed=seed, model="qwen3-30b-shaped")
    clock = SimClock()
    counts = {"copies": 0, "copy_calls": 0, "fences": 0, "tasks": 0}

    class BatchingSimTransport(SimTransport):
        """The virtual copy stream, counting; ``copy_batch``: the copies in stream order, one handle (the last's
        completion: the stream is in order)."""

        def copy(self, dst, src, after=()):
            counts["copies"] += 1
            counts["copy_calls"] += 1
            return super().copy(dst, src, after)

        def copy_batch(self, pairs, after=()):
            counts["copy_calls"] += 1
            handle = None
            for dst, src in pairs:
                counts["copies"] += 1
                handle = SimTransport.copy(self, dst, src, after)
            return handle

        def compute_fence(self):
            counts["fences"] += 1
            return super().compute_fence()

    class CountingEngine(SimCopyEngine):
        def submit(self, *args, **kwargs):
            counts["tasks"] += 1
            return super().submit(*args, **kwargs)

    transport = BatchingSimTransport(clock, bandwidth_bps=prof.bandwidth_bps, latency_s=prof.h2d_latency_us * 1e-6,
                                     scale=1.0, region_bytes=fmt.nbytes, num_experts=E)
    counts_now: list[int] = []

    def compute(layer: int, topk_ids: torch.Tensor, experts: list[int]) -> None:
        transport.compute(sum(prof.expert_s(counts_now[e]) for e in experts), "expert")

    stats = Stats()
    plat = Platform(clock=clock, transport=lambda config, device: transport, copy_engine=CountingEngine,
                    host_store=SimHostStore, compute=compute)
    config = OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync", pin_memory=False)
    backend = create_expert_backend(config, fmt=fmt, num_layers=L, num_experts=E, top_k=k, device="cpu",
                                    kernels_backend="torch", gates=gate_modules(gates), reserved_bytes=0,
                                    stats=stats, platform=plat)
    backend.finish_loading()
    transport.synchronize()

    alloc_s: list[float] = []  # thread CPU seconds per allocate call: robust to preemption on a loaded machine
    real_allocate = backend.cache.allocate

    def timed_allocate(*args, **kwargs):
        t0 = time.thread_time()
        slot = real_allocate(*args, **kwargs)
        if stats.phase == "decode":
            alloc_s.append(time.thread_time() - t0)
        return slot

    backend.cache.allocate = timed_allocate
    pred_s = [0.0]
    pred = backend.predictor
    if pred is not None:
        for name in ("observe", "propose", "begin_step", "observe_host", "collect_proposals"):
            real = getattr(pred, name)

            def timed(*args, _real=real, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    if stats.phase == "decode":
                        pred_s[0] += time.perf_counter() - t0
            setattr(pred, name, timed)

    from moeflow.moe.backend import StepInfo
    from moeflow.trace import DECODE
    forward_s: list[float] = []
    forward_cpu_s: list[float] = []
    decode_counts = None
    steps = 0
    t_virtual = 0.0
    for row in range(len(trace)):
        phase = "decode" if int(trace.phase[row]) == DECODE else "prefill"
        if phase == "decode" and decode_counts is None:
            decode_counts = dict(counts)
            t_virtual = clock.now
        stats.set_phase(phase)
        rows = slice(row, row + 1) if phase == "decode" else None
        if phase == "prefill":
            if row > 0:
                continue  # the whole prompt is one pass
            rows = slice(0, int((trace.phase == 0).sum()))
        T = rows.stop - rows.start
        ids_tok = trace.token_ids[rows].long()[None]
        pos = torch.arange(rows.start, rows.stop)[None]
        info = StepInfo(ids_tok, pos, torch.ones_like(ids_tok, dtype=torch.bool), phase, None,
                        torch.zeros(1, T, 64), trace.token_ids[:rows.stop].long()[None],
                        torch.ones(1, rows.stop, dtype=torch.bool))
        backend.begin_step(info)
        for l in range(L):
            topk = trace.topk_ids[rows, l]
            counts_now = torch.bincount(topk.reshape(-1).long(), minlength=E).tolist()
            transport.compute(prof.attn_s(T), "attention")
            clock.advance_to(transport.compute_free)  # the routing read-back
            probs = trace.probs[rows, l].float()
            w = probs.gather(1, topk.long())
            x = trace.hidden[rows, l].float()
            t0, c0 = time.perf_counter(), time.thread_time()
            backend.forward(l, x, probs, topk, w / w.sum(-1, keepdim=True))
            if phase == "decode":
                forward_s.append(time.perf_counter() - t0)
                forward_cpu_s.append(time.thread_time() - c0)
        transport.compute(prof.head_s, "head")
        clock.advance_to(transport.compute_free)
        steps += phase == "decode"
    backend.close()
    per_layer = steps * L
    d = stats.decode
    out = {
        "policy": policy, "slots": slots, "decode_steps": steps,
        "host_us_median": statistics.median(forward_s) * 1e6, "host_us_mean": statistics.fmean(forward_s) * 1e6,
        "host_cpu_us_median": statistics.median(forward_cpu_s) * 1e6,
        "host_cpu_us_mean": statistics.fmean(forward_cpu_s) * 1e6,
        "hit_rate": d.hits / max(d.hits + d.misses, 1), "virtual_ms_per_token": (clock.now - t_virtual) / steps * 1e3,
        "allocations": len(alloc_s),
        "eviction_us_per_allocation": statistics.fmean(alloc_s) * 1e6 if alloc_s else None,
        "eviction_us_median": statistics.median(alloc_s) * 1e6 if alloc_s else None,
        "eviction_us_p99": sorted(alloc_s)[int(0.99 * len(alloc_s))] * 1e6 if alloc_s else None,
        "predictor_us_per_layer": pred_s[0] / per_layer * 1e6 if pred is not None else None,
    }
    for key in counts:
        out[f"{key}_per_layer"] = (counts[key] - decode_counts[key]) / per_layer
    # on CUDA every copy call records one event (before batching: one per copy), every compute fence one
    out["events_per_layer"] = out["copy_calls_per_layer"] + out["fences_per_layer"]
    return out


# ------------------------------------------------------------------------------------------------ driver
def _worker(args) -> None:
    torch.set_num_threads(1)
    results = [run_one(p, s, tokens=args.tokens, prompt=args.prompt, seed=args.seed) for p, s in args.configs]
    print(json.dumps(results))


def _run_tree(tree: Path, args, configs) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tokens", str(args.tokens), "--prompt",
           str(args.prompt), "--seed", str(args.seed), "--configs", ",".join(f"{p}:{s}" for p, s in configs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _git_rev(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "n/a (exported tree)"


def _median_runs(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and key != "slots"):
            vals = [r[key] for r in runs if r[key] is not None]
            out[key] = statistics.median(vals) if vals else None
    out["host_us_median_runs"] = [r["host_us_median"] for r in runs]
    return out


FIELDS = (("host_us_median", "host us (median)", "{:.0f}"), ("host_cpu_us_median", "host CPU us (median)", "{:.0f}"),
          ("host_cpu_us_mean", "host CPU us (mean)", "{:.0f}"),
          ("copies_per_layer", "copies", "{:.1f}"), ("events_per_layer", "events", "{:.1f}"),
          ("tasks_per_layer", "tasks", "{:.1f}"), ("eviction_us_median", "alloc us (median)", "{:.1f}"),
          ("eviction_us_per_allocation", "alloc us (mean)", "{:.1f}"), ("eviction_us_p99", "alloc us (p99)", "{:.0f}"),
          ("predictor_us_per_layer", "predictor us", "{:.0f}"), ("hit_rate", "hit rate", "{:.2f}"),
          ("virtual_ms_per_token", "virtual ms/token", "{:.1f}"))


def table(result: dict) -> str:
    """Markdown: one row per configuration and tree."""
    lines = ["| policy | slots | tree | " + " | ".join(f[1] for f in FIELDS) + " |",
             "|---|---:|---|" + "---:|" * len(FIELDS)]
    for cfg in result["configs"]:
        for tree, r in cfg["trees"].items():
            cells = [("" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in FIELDS]
            lines.append(f"| {cfg['policy']} | {cfg['slots']} | {tree} | " + " | ".join(cells) + " |")
    lines.append(f"\nload average before/after: {result['load_before']} / {result['load_after']} "
                 f"({os.cpu_count()} cores)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree to measure (repeatable); default: after=. (this checkout)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps per run")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(f"{p}:{s}" for p, s in CONFIGS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print the Markdown table of a result file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.configs = [(p, int(s)) for p, s in (c.split(":") for c in args.configs.split(","))]
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.worker:
        _worker(args)
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"after": "."}
    result = {"load_before": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version(),
              "profile": PROFILE, "tokens": args.tokens, "prompt": args.prompt, "repeats": args.repeats,
              "trees": {name: {"path": str(Path(p).resolve()), "rev": _git_rev(Path(p))} for name, p in trees.items()}}
    runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        for name, path in trees.items():  # alternate trees within a repeat: the load hits both alike
            runs[name].append(_run_tree(Path(path), args, args.configs))
            print(f"repeat {rep} {name}: done (load {os.getloadavg()[0]:.2f})", flush=True)
    result["configs"] = [
        {"policy": p, "slots": s, "trees": {name: _median_runs([r[i] for r in runs[name]]) for name in trees}}
        for i, (p, s) in enumerate(args.configs)]
    result["load_after"] = os.getloadavg()
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
