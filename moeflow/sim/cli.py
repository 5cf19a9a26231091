"""``moeflow simulate`` and ``moeflow bench profile``: ``register(subparsers)`` adds them to the ``moeflow`` command."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from moeflow.errors import SchedulingError
from moeflow.offload import get_policy
from moeflow.sim.llamacpp import LLAMACPP_POLICY
from moeflow.sim.profile import PRESET_NAMES, HardwareProfile, ProfileError, custom_profile, get_profile
from moeflow.sim.simulator import CPU_COMPUTE_MODES, SimResult, SimulationError, check_policy, known_policies

# profile fields the command line can override: flag -> field
OVERRIDES = {
    "h2d_gbps": "h2d_gbps", "latency_us": "h2d_latency_us", "layer_ms": "attn_ms",
    "layer_ms_per_token": "attn_ms_per_token", "expert_ms": "expert_ms", "expert_ms_per_token": "expert_ms_per_token",
    "head_ms": "head_ms", "sched_ms": "sched_ms", "disk_gbps": "disk_gbps", "disk_latency_us": "disk_latency_us",
    "cpu_gbps": "cpu_gbps", "cpu_call_us": "cpu_call_us", "cpu_token_ms": "cpu_token_ms",
    "cpu_free_tokens": "cpu_free_tokens",
}


def build_profile(args: argparse.Namespace) -> HardwareProfile:
    """--profile P (preset or JSON) with the flags' overrides; or a custom profile from --h2d-gbps and --expert-mb.

    --expert-mb describes another model's experts, so it lifts the profile's layer/expert counts.
    """
    overrides: dict[str, Any] = {field: getattr(args, flag) for flag, field in OVERRIDES.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.profile:
        prof = get_profile(args.profile)
        if args.expert_mb is not None:
            overrides.update(expert_bytes=max(1, int(round(args.expert_mb * 2**20))), num_layers=None,
                             num_experts=None, top_k=None)
        return replace(prof, **overrides) if overrides else prof
    if args.h2d_gbps is None or args.expert_mb is None:
        raise ProfileError("give a hardware profile (--profile " + "|".join(PRESET_NAMES) + "|FILE.json) or at least "
                           "--h2d-gbps and --expert-mb")
    overrides.pop("h2d_gbps")
    latency = overrides.pop("h2d_latency_us", 10.0)
    return custom_profile(h2d_gbps=args.h2d_gbps, expert_mb=args.expert_mb, latency_us=latency, **overrides)


def _slots(text: str) -> list[int]:
    try:
        out = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise SimulationError(f"--slots {text!r}: expected a number of slots or a comma-separated list") from None
    if not out or any(n < 1 for n in out):
        raise SimulationError(f"--slots {text!r}: slot counts must be >= 1")
    return out


def _host_gb(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    try:
        out = [float(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise SimulationError(f"--host-memory-gb {text!r}: expected GB or a comma-separated list") from None
    if not out or any(g <= 0 for g in out):
        raise SimulationError(f"--host-memory-gb {text!r}: budgets must be > 0")
    return out


def _cpu_modes(text: str | None) -> list[str | None]:
    """--cpu-compute: None (the policy's own), or modes; "never" runs copy-only (no cpu_compute)."""
    if not text:
        return [None]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in CPU_COMPUTE_MODES]
    if bad or not modes:
        raise SimulationError(f"--cpu-compute {text!r}: expected {', '.join(CPU_COMPUTE_MODES)} or a comma-separated "
                              "list of them")
    return [None if m == "never" else m for m in modes]


def _takes_cpu_compute(policy: str) -> bool:
    """--cpu-compute applies to the caching policies: not to resident, llama.cpp's placement, or policies that fix
    their own CPU compute (fiddler)."""
    if policy == "oracle":
        return True
    if policy in ("resident", LLAMACPP_POLICY):
        return False
    return get_policy(policy).cpu_compute is None


def format_table(results: list[SimResult]) -> str:
    """The per-policy table (see docs/simulator.md: how to read it; docs/disk.md for the host column)."""
    disk = any(r.host_experts is not None and r.host_experts < r.total_experts for r in results)
    cpu = any(r.cpu_experts for r in results)
    batched = any(r.batch != 1 for r in results)
    head = ("| policy | slots | TTFT ms | TPOT ms | tok/s | x bound | hit rate (prefill / decode) | GiB moved | "
            "decode stall ms/token | prefetches (useful / wasted) |")
    if batched:  # a decode pass carries a token of each running sequence: TPOT and the stall are per pass
        head = head.replace("TPOT ms", "decode pass ms | ms/token").replace("stall ms/token", "stall ms/pass")
    head += " CPU experts/token (decode) |" if cpu else ""
    head += " host experts | disk GiB read |" if disk else ""
    lines = [head, "|" + "---|" * (10 + batched + cpu + 2 * disk)]
    for r in results:
        ttft = f"{r.ttft_s * 1e3:.1f}" if r.ttft_s is not None else "n/a"
        tpot = f"{r.tpot_s * 1e3:.2f}" if r.tpot_s is not None else "n/a"
        per_token = r.time_per_generated_token_s
        if batched:
            tpot += f" | {per_token * 1e3:.2f}" if per_token is not None else " | n/a"
        tps = f"{1 / per_token:.1f}" if per_token else "n/a"
        bound = f"{r.tpot_s / r.decode_bound_s:.2f}" if r.tpot_s and r.decode_bound_s else "n/a"
        stall = f"{r.decode_stall_s / r.decode_steps * 1e3:.2f}" if r.decode_steps else "n/a"
        lines.append(
            f"| {r.policy} | {r.slots}/{r.total_experts} | {ttft} | {tpot} | {tps} | {bound} | "
            f"{r.hit_rate:.1%} ({r.prefill_hit_rate:.1%} / {r.decode_hit_rate:.1%}) | {r.bytes_h2d / 2**30:.2f} | "
            f"{stall} | {r.prefetches} ({r.useful_prefetches} / {r.wasted_prefetches}) |"
            + (f" {r.decode_cpu_experts / max(r.decode_steps, 1):.1f} |" if cpu else "")
            + (f" {r.host_experts}/{r.total_experts} | {r.disk_bytes / 2**30:.2f} |" if disk else ""))
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    from moeflow.sim.simulator import load_gates, simulate
    from moeflow.trace import Trace

    profile = build_profile(args)
    trace = Trace.load(args.trace)
    profile.check_trace(trace.num_layers, trace.num_experts, trace.top_k, f"trace {args.trace}")
    slot_list = _slots(args.slots)
    gates = load_gates(args.gates, trace.num_layers) if args.gates else None
    predictor_dir = args.predictors or (args.gates if args.gates and Path(args.gates).is_dir() else None)
    if args.policy == "all":
        policies = known_policies()
    else:
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        for p in policies:
            check_policy(p)
    results: list[SimResult] = []
    skipped: list[str] = []
    host_list = _host_gb(args.host_memory_gb)
    if host_list != [None] and profile.disk_gbps is None:
        raise ProfileError(f"--host-memory-gb: profile {profile.name!r} has no disk; give --disk-gbps (or a profile "
                           "measured by `moeflow bench profile`)")
    modes = _cpu_modes(args.cpu_compute)
    runs = [(p, m) for p in policies for m in (modes if _takes_cpu_compute(p) else [None])]
    runs = list(dict.fromkeys(runs))
    for policy, cpu_mode in runs:
        for slots, host_gb in [(s, h) for s in ([max(slot_list)] if policy == "resident" else slot_list)
                               for h in host_list]:
            host_experts = None if host_gb is None else int(host_gb * 2**30 // profile.expert_bytes)
            try:
                r = simulate(trace, policy, slots, profile, copy_chunks=args.copy_chunks,
                             max_inflight_chunks=args.max_inflight, prefetch_distance=args.prefetch_distance,
                             gates=gates, max_sequences=args.max_sequences, timeline=bool(args.plot),
                             host_experts=host_experts, early_hits=not args.serial_schedule,
                             predictor_dir=predictor_dir, cpu_compute=cpu_mode, cpu_workers=args.cpu_workers,
                             batch=args.batch)
            except (SimulationError, SchedulingError, ProfileError) as e:  # e.g. a predictor without its file
                if args.policy != "all":
                    raise
                skipped.append(f"{policy}{'' if cpu_mode is None else '+cpu-' + cpu_mode}: {e}")
                break
            results.append(r)
    if args.json:
        print(json.dumps({"profile": profile.as_dict(), "trace": str(args.trace),
                          "results": [r.as_dict() for r in results], "skipped": skipped}, indent=1))
    else:
        batch = f", batch {args.batch}" if args.batch != 1 else ""
        print(f"trace {args.trace}: {trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}, "
              f"{len(trace.sequence_ids())} sequences{batch}; profile {profile.name!r} ({profile.h2d_gbps:g} GB/s, "
              f"{profile.expert_bytes / 2**20:.1f} MiB per expert)")
        print(format_table(results))
        for s in skipped:
            print(f"skipped {s}")
    if args.plot:
        from moeflow.sim.plot import plot_timeline

        out = Path(args.plot)
        for r in results:
            path = out if len(results) == 1 else out.with_name(f"{out.stem}-{r.policy}-{r.slots}{out.suffix}")
            plot_timeline(r, path)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_bench_profile(args: argparse.Namespace) -> int:
    from moeflow.sim.bench import measure_profile

    prof = measure_profile(args.device, args.shape, repeats=args.repeats, name=args.name)
    if args.out:
        prof.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    print(json.dumps(prof.as_dict(), indent=2))
    if not args.device and "NO GPU" in prof.description:
        print("note: no GPU here; this profile describes the CPU path", file=sys.stderr)
    return 0


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="replay a routing trace through the scheduler on simulated hardware")
    p.add_argument("--trace", required=True, help="trace file (moeflow trace)")
    p.add_argument("--policy", default="all", help="a policy, a comma-separated list, or 'all' "
                   f"({', '.join(known_policies())})")
    p.add_argument("--slots", required=True, help="device expert slots (or a comma-separated list)")
    p.add_argument("--profile", default=None, help=f"preset ({', '.join(PRESET_NAMES)}) or a JSON profile")
    p.add_argument("--h2d-gbps", type=float, default=None, help="host->device GB/s")
    p.add_argument("--latency-us", type=float, default=None, help="fixed cost of one copy call (us)")
    p.add_argument("--expert-mb", type=float, default=None, help="MiB per expert")
    p.add_argument("--layer-ms", type=float, default=None, help="non-MoE compute per layer and pass (ms)")
    p.add_argument("--layer-ms-per-token", type=float, default=None)
    p.add_argument("--expert-ms", type=float, default=None, help="one expert call (ms)")
    p.add_argument("--expert-ms-per-token", type=float, default=None)
    p.add_argument("--head-ms", type=float, default=None, help="embedding + LM head per pass (ms)")
    p.add_argument("--sched-ms", type=float, default=None, help="host scheduling per offloaded layer (ms)")
    p.add_argument("--host-memory-gb", default=None, help="host expert cache in GiB (or a comma-separated list); "
                   "experts beyond it are read from the profile's disk (docs/disk.md)")
    p.add_argument("--disk-gbps", type=float, default=None, help="disk read GB/s (cold, expert-sized reads)")
    p.add_argument("--disk-latency-us", type=float, default=None, help="latency of one disk read (us)")
    p.add_argument("--cpu-compute", default=None, help="hybrid execution for the caching policies: auto, always or "
                   "never (copy-only), or a comma-separated list of them to run each (fiddler always computes on the "
                   "CPU; llamacpp-n-cpu-moe is llama.cpp's placement)")
    p.add_argument("--cpu-workers", type=int, default=1, help="CPU expert workers (OffloadConfig.cpu_workers)")
    p.add_argument("--cpu-gbps", type=float, default=None, help="GB/s of expert weights one CPU call streams")
    p.add_argument("--cpu-call-us", type=float, default=None, help="fixed cost of one CPU expert call (us)")
    p.add_argument("--cpu-token-ms", type=float, default=None, help="CPU ms per token past the free ones")
    p.add_argument("--cpu-free-tokens", type=float, default=None, help="tokens whose CPU arithmetic hides under "
                   "the weight read")
    p.add_argument("--copy-chunks", type=int, default=3)
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--prefetch-distance", type=int, default=1)
    p.add_argument("--gates", default=None, help="the routers (checkpoint dir or *.gates.safetensors), for "
                   "mixtral-offloading's speculation")
    p.add_argument("--predictors", default=None, metavar="CHECKPOINT_DIR",
                   help="the checkpoint whose predictors/<kind>.pt the learned policies load (duoserve, promoe, "
                        "expertflow: `moeflow train-predictor`); default: the --gates directory")
    p.add_argument("--max-sequences", type=int, default=None)
    p.add_argument("--batch", type=int, default=1, help="sequences of the trace decoded together: each group of B "
                   "prefilled in one pass, then one decode pass of B tokens per step (moeflow/sim/batched.py)")
    p.add_argument("--serial-schedule", action="store_true",
                   help="a layer's experts run after the host's scheduling (OffloadConfig.early_hits=False); "
                        "default: the experts in slots run while the host schedules, as on a GPU")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", default=None, help="draw the prefill / decode timeline to this PNG")
    p.set_defaults(func=cmd_simulate)
    return p


def add_bench_profile_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("profile", help="measure a hardware profile for the simulator on this machine")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--shape", default="auto", choices=["auto", "mixtral-8x7b", "tiny"],
                   help="expert shape to time (auto: Mixtral-8x7B on a GPU, tiny on the CPU)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=None, help="write the profile JSON here")
    p.set_defaults(func=cmd_bench_profile)
    return p


def register(subparsers: Any) -> None:
    """Add ``simulate`` and ``bench profile`` (``bench`` holds its subcommands; others may add theirs)."""
    add_simulate_parser(subparsers)
    bench = subparsers.add_parser("bench", help="benchmarks of the machine at hand")
    add_bench_profile_parser(bench.add_subparsers(dest="bench_command", required=True))
