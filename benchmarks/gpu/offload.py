"""GPU offload benchmark: Mixtral-8x7B-shaped AWQ checkpoint, H2D bandwidth, per-policy TTFT/TPOT, memory, trace.

One run does everything (a lent GPU machine starts bare, so the checkpoint is written in the same run):

1. writes a synthetic checkpoint with the exact tensor shapes of Mixtral-8x7B in AWQ 4-bit, group 128
   (random weights, ~24.6 GB on disk; ``--layers`` writes fewer layers of the same shapes);
2. loads it once (experts into the pinned host store) and measures host->device bandwidth of one expert
   region (one copy, and chunked as the copy engine does) against the best copy rate seen in the same run
   (PyTorch's pinned allocator, a 1 GiB pinned buffer);
3. for each slot budget and policy: TTFT of a prompt, TPOT of greedy decoding, hit rates, bytes moved,
   stall time, peak GPU memory, and whether the tokens equal the resident run's (the invariant, on real
   streams). Policies share the one host store, so nothing is reloaded;
4. records a torch profiler trace of a few decode steps and reports how much copy time overlapped compute.

Results go to ``--out`` (JSON + a Markdown table) after every configuration, so a run cut short still
leaves numbers. ``--tiny`` runs the same code on the CPU with a tiny checkpoint (for CI and development).

    python -m benchmarks.gpu.offload --out benchmarks/results/gpu_offload         # on a GPU
    python -m benchmarks.gpu.offload --tiny --out /tmp/offload_tiny                  # anywhere
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import (
    add_checkpoint_args,
    checkpoint_bytes,
    mixtral_setup,
    write_synthetic_awq_checkpoint,
)
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.moe import ResidentExperts
from moeflow.offload import OffloadedExperts, chunk_ranges, create_expert_backend, min_slots

POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")


# ------------------------------------------------------------------------------------------ measurements
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_rate(src: torch.Tensor, dst: torch.Tensor, chunks: int, repeats: int, device: torch.device) -> float:
    """GB/s of copying ``src`` into ``dst`` (uint8, same size) ``repeats`` times, in ``chunks`` copies each."""
    ranges = chunk_ranges(src.numel(), chunks)
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(repeats):
                for a, b in ranges:
                    dst[a:b].copy_(src[a:b], non_blocking=True)
            end.record(stream)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(repeats):
            for a, b in ranges:
                dst[a:b].copy_(src[a:b])
        seconds = time.perf_counter() - t0
    return repeats * src.numel() / seconds / 1e9


def measure_h2d(host, device: torch.device, repeats: int) -> dict:
    """Bandwidth of one expert from the host store into a device slot, against the best rate in this run."""
    nbytes = host.fmt.nbytes
    slot = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pin = device.type == "cuda"
    region = host.region(0, 0)
    rates = {
        "host_store_expert_1_copy": _copy_rate(region, slot, 1, repeats, device),
        "host_store_expert_3_chunks": _copy_rate(region, slot, 3, repeats, device),
        "torch_pinned_expert_1_copy": _copy_rate(
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), slot, 1, repeats, device
        ),
        "pageable_expert_1_copy": _copy_rate(torch.empty(nbytes, dtype=torch.uint8), slot, 1, max(2, repeats // 4),
                                             device),
    }
    big = min(2**30, 16 * nbytes)
    rates["torch_pinned_1GiB"] = _copy_rate(
        torch.empty(big, dtype=torch.uint8, pin_memory=pin), torch.empty(big, dtype=torch.uint8, device=device), 1,
        max(2, repeats // 8), device,
    )
    best = max(v for k, v in rates.items() if not k.startswith("pageable"))
    return {
        "expert_bytes": nbytes, "host_store_pinned": host.pinned, "GBps": rates, "best_GBps": best,
        "expert_fraction_of_best": rates["host_store_expert_1_copy"] / best,
        "chunked_fraction_of_best": rates["host_store_expert_3_chunks"] / best,
        "target_fraction": 0.9,
    }


def _free(model: MoEOffloadedMixtral) -> None:
    """Close the model's expert backend (the host store stays: the next backend shares it, pinned)."""
    backend = model.experts
    host = getattr(backend, "host", None)
    was_pinned = bool(getattr(host, "pinned", False))
    if hasattr(backend, "close"):
        backend.close()
    if was_pinned and not host.pinned:
        # the backend from_pretrained built owns the store and unregisters its pages on close: register them
        # again, else every later backend copies from pageable memory (half the bandwidth, no overlap)
        host.pin()
    model.use_backend(None)
    del backend
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def install_backend(model: MoEOffloadedMixtral, host, policy: str, slots: int | None, transport: str,
                    early_hits: bool | None = None) -> object:
    """Swap the model's expert backend for ``policy`` at ``slots``, sharing the already filled host store
    (``early_hits``: OffloadConfig's; None is on on CUDA)."""
    _free(model)
    cfg, device = model.config, model.device
    if policy == "resident":
        backend = ResidentExperts(host.fmt, cfg.num_hidden_layers, cfg.num_local_experts, device, model.kernels)
        backend.pool.buffer.copy_(host.buffer)  # the store's rows are in the resident slot order
    else:
        backend = create_expert_backend(
            OffloadConfig(policy=policy, gpu_expert_slots=slots, transport=transport, early_hits=early_hits),
            fmt=host.fmt,
            num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
            device=device, kernels_backend=model.kernels, gates=[b.gate for b in model.model.moe_blocks],
            reserved_bytes=0, stats=model.stats, host_store=host,
        )
        backend.finish_loading()
    model.use_backend(backend)
    _sync(device)
    return backend


def run_config(
    model, prompt: torch.Tensor, new_tokens: int, expected: torch.Tensor | None, **generate_kwargs
) -> tuple[dict, torch.Tensor]:
    """One timed greedy ``generate`` (``generate_kwargs``: e.g. ``eos_token_id=[]`` to decode every token)."""
    device = model.device
    model.stats.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
    _sync(device)
    wall = time.perf_counter() - t0
    s = model.stats
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    row = {
        "ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "tok_per_s": (1 / s.tpot_s) if s.tpot_s else None, "wall_s": wall,
        "peak_gpu_bytes": peak, "stats": s.as_dict(), "summary": s.summary(),
        "tokens_equal_reference": None if expected is None else bool(torch.equal(out.cpu(), expected.cpu())),
    }
    return row, out


def trace_overlap(trace_path: Path) -> dict | None:
    """From a chrome trace: share of host->device copy time that overlapped a kernel on another stream."""
    try:
        events = json.loads(trace_path.read_text()).get("traceEvents", [])
    except (OSError, json.JSONDecodeError):
        return None
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not copies:
        return None
    kernels.sort()
    copy_time = sum(b - a for a, b, _ in copies)
    overlapped = 0.0
    for a, b, tid in copies:
        spans = sorted((max(a, ka), min(b, kb)) for ka, kb, ktid in kernels if ktid != tid and ka < b and kb > a)
        end = a
        for s, e in spans:  # union of the overlapping kernel intervals
            s = max(s, end)
            if e > s:
                overlapped += e - s
                end = e
    return {"htod_copies": len(copies), "htod_us": copy_time, "overlapped_us": overlapped,
            "overlap_fraction": overlapped / copy_time if copy_time else 0.0, "kernels": len(kernels)}


def profile_decode(model, prompt: torch.Tensor, tokens: int, out_dir: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model.generate(prompt, max_new_tokens=tokens, do_sample=False)
        _sync(model.device)
    path = out_dir / "offload_trace.json"
    prof.export_chrome_trace(str(path))
    overlap = trace_overlap(path)
    # gzip: a 32-layer trace can pass the 16 MiB a device command may hand back per file
    packed = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return {"trace": packed.name, "bytes": packed.stat().st_size, "overlap": overlap}


# ------------------------------------------------------------------------------------------ report
def write_report(out_dir: Path, result: dict) -> None:
    (out_dir / "offload_results.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# moeflow offload benchmark ({result['env'].get('device_name', 'cpu')})", ""]
    bw = result.get("h2d")
    if bw:
        lines += [f"H2D: one expert ({bw['expert_bytes'] / 2**20:.1f} MiB) "
                  f"{bw['GBps']['host_store_expert_1_copy']:.1f} GB/s = {bw['expert_fraction_of_best']:.0%} of the "
                  f"best rate in this run ({bw['best_GBps']:.1f} GB/s; target 90%); chunked x3 "
                  f"{bw['chunked_fraction_of_best']:.0%}; host store pinned: {bw['host_store_pinned']}", ""]
    full = result.get("full_model_bytes")
    lines += ["| policy | slots | expert GiB | TTFT s | TPOT ms | tok/s | decode hit | MiB moved | stall ms | "
              "peak GiB | % of model | tokens = resident |", "|" + "---|" * 12]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['slots']} | error: {r['error']} |" + " |" * 9)
            continue
        st = r["stats"]
        moved = (st["prefill"]["bytes_h2d"] + st["decode"]["bytes_h2d"]) / 2**20
        stall = (st["prefill"]["stall_s"] + st["decode"]["stall_s"]) * 1e3
        peak = r["peak_gpu_bytes"]
        lines.append(
            f"| {r['policy']} | {r['slots']} | {r['expert_pool_bytes'] / 2**30:.2f} | {r['ttft_s']:.3f} | "
            f"{(r['tpot_s'] or 0) * 1e3:.1f} | {r['tok_per_s'] or 0:.2f} | {st['decode']['hit_rate']:.0%} | "
            f"{moved:.0f} | {stall:.0f} | {(peak or 0) / 2**30:.2f} | "
            f"{(peak / full * 100) if (peak and full) else float('nan'):.1f} | {r['tokens_equal_reference']} |"
        )
    if result.get("profile"):
        ov = result["profile"].get("overlap") or {}
        lines += ["", f"Trace: {result['profile']['trace']}; copy/compute overlap: "
                  f"{ov.get('overlap_fraction', float('nan')):.0%} of {ov.get('htod_us', 0) / 1e3:.1f} ms "
                  "of H2D copies"]
    (out_dir / "offload_results.md").write_text("\n".join(lines) + "\n")


def run_env(device: torch.device, argv: list[str] | None) -> dict:
    """Versions, arguments and the device, for the results' ``env``."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "argv": sys.argv[1:] if argv is None else argv, "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory)
    return env


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--budgets", default=None, help="comma-separated slot counts (default: min,16,64,128)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--no-resident", action="store_true", help="skip the all-resident baseline")
    ap.add_argument("--trace-tokens", type=int, default=4)
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="stop starting configurations after this")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_offload"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, dtype, config, kernels, group, ckpt = mixtral_setup(args)
    if args.tiny:
        budgets = [int(b) for b in (args.budgets or "2,5,16").split(",")]
        prompt_len, new_tokens = args.prompt_len or 12, args.new_tokens or 6
    else:
        budgets = [int(b) for b in (args.budgets or "2,16,64,128").split(",")]
        prompt_len, new_tokens = args.prompt_len or 128, args.new_tokens or 16
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"env": run_env(device, argv), "config": config, "runs": []}

    t0 = time.perf_counter()
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    result["checkpoint"] = {"path": str(ckpt), "write_s": time.perf_counter() - t0}
    result["full_model_bytes"] = checkpoint_bytes(ckpt)

    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    smallest = min_slots(OffloadConfig(), k)
    budgets = sorted({max(smallest, min(b, L * E)) for b in budgets})
    t0 = time.perf_counter()
    model = MoEOffloadedMixtral.from_pretrained(
        ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
        offload=OffloadConfig(policy="lru", gpu_expert_slots=smallest, transport=args.transport),
    )
    host = model.experts.host
    result["checkpoint"]["load_s"] = time.perf_counter() - t0
    try:
        result["h2d"] = measure_h2d(host, device, repeats=3 if args.tiny else 20)
        print(f"h2d: one expert {result['h2d']['GBps']['host_store_expert_1_copy']:.1f} GB/s = "
              f"{result['h2d']['expert_fraction_of_best']:.0%} of the best copy", flush=True)
    except Exception as exc:  # the policy runs below do not need it
        result["h2d_error"] = f"{type(exc).__name__}: {exc}"
    write_report(args.out, result)

    prompt = torch.randint(3, config["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    # warm-up at the measured shape (Triton specializations, cuDNN attention plans, allocator): not measured; an
    # 8-token warm-up left the first H100 run's resident row paying them (3.4 s TTFT, an 842 ms attention call)
    model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)

    expected = None
    plan: list[tuple[str, int]] = []
    resident_bytes = L * E * host.fmt.nbytes
    fits = device.type == "cpu" or resident_bytes < 0.85 * torch.cuda.get_device_properties(device).total_memory
    if not args.no_resident and fits:
        plan.append(("resident", L * E))
    plan += [(p, b) for b in budgets for p in args.policies.split(",")]
    for policy, slots in plan:
        if time.perf_counter() - t_start > args.time_budget_s:
            result["runs"].append({"policy": policy, "slots": slots, "error": "skipped: time budget"})
            continue
        try:
            backend = install_backend(model, host, policy, slots, args.transport)
            row, out = run_config(model, prompt, new_tokens, expected)
        except Exception as exc:  # keep going: one failing configuration must not lose the others
            result["runs"].append({"policy": policy, "slots": slots, "error": f"{type(exc).__name__}: {exc}"})
            write_report(args.out, result)
            continue
        if expected is None:
            expected = out  # resident when it fits, else the first offloaded run
        pool_bytes = backend.pool.buffer.numel()
        row.update(policy=policy, slots=slots, expert_pool_bytes=pool_bytes,
                   transport=getattr(getattr(backend, "transport", None), "name", "none"))
        result["runs"].append(row)
        write_report(args.out, result)
        print(f"{policy:>20} slots={slots:>4}: {row['summary']}", flush=True)

    mid = budgets[len(budgets) // 2]
    policy = "mixtral-offloading" if "mixtral-offloading" in args.policies else args.policies.split(",")[0]
    try:
        install_backend(model, host, policy, mid, args.transport)
        result["profile"] = {"policy": policy, "slots": mid, **profile_decode(model, prompt[:, :16],
                                                                                args.trace_tokens, args.out)}
    except Exception as exc:  # the runs above are already written
        result["profile_error"] = f"{type(exc).__name__}: {exc}"
    result["total_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    if isinstance(model.experts, OffloadedExperts):
        model.experts.close()
    print((args.out / "offload_results.md").read_text())
    return result


if __name__ == "__main__":
    main()
