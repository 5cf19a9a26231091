"""CUDA-graph decode and the disk tier on a GPU, on the synthetic Mixtral-8x7B AWQ checkpoint of gpu/offload.py.

    python -m benchmarks.gpu.engine --checkpoint /tmp/moeflow-mixtral-8x7b-awq --out $OUT/engine   # a GPU
    python -m benchmarks.gpu.engine --tiny --out /tmp/engine_tiny                                  # anywhere

1. ``cuda_graphs``: the model is loaded once (experts in the pinned host store); for ``resident`` and ``lru`` at
   ``--slots`` (the backends share that store, as in gpu/offload.py), a greedy decode is timed eagerly, then with
   the decode step captured as CUDA graphs (``model.capture_decode()``, what ``cuda_graphs=True`` does; a first
   ``generate`` of the same shape captures, the timed one replays). Reported: decode tok/s both ways, the ratio,
   whether the captured tokens equal the eager ones, the capture count and the refusal reason if the device
   refused the capture (the step then ran eagerly: the ratio is then ~1 and says nothing about graphs).
2. ``disk``: the same checkpoint loaded with ``OffloadConfig(policy="lru", gpu_expert_slots=--slots,
   host_memory_gb=G)`` for each ``--host-gb`` (the experts that do not fit in host memory are read from the
   checkpoint into pinned host rows, then copied by the CUDA transport), the checkpoint's pages dropped from
   the page cache before the timed run. Reported: decode tok/s, disk bytes and stall per token, whether the
   host rows are pinned, the transport, and whether the tokens equal the all-in-RAM ``lru`` run's and the
   resident run's (the exact-token invariant across tiers).

Results are rewritten to ``--out/engine_results.json`` (+ a Markdown table) after every measurement, each
measurement prints one summary line, and a failing one is recorded and the run goes on. ``--tiny`` runs the same
code on the CPU with a tiny checkpoint; the graphs are then captured by the tests' CPU stand-in for CUDA graphs
(tests/graph_capture.py ``TraceCapture``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import (
    add_checkpoint_args,
    checkpoint_bytes,
    mixtral_setup,
    write_synthetic_awq_checkpoint,
)
from benchmarks.disk.tier import drop_page_cache
from benchmarks.gpu.offload import install_backend, run_config, run_env
from moeflow import MoEOffloadedMixtral, OffloadConfig


def cpu_capture_factory():
    """The tests' CPU stand-in for CUDA graphs (records a piece's aten ops, replays them on the same tensors)."""
    from tests.graph_capture import TraceCapture

    return TraceCapture


def load_in_ram(ckpt: Path, device, dtype, kernels: str, slots: int) -> MoEOffloadedMixtral:
    """Every expert in the pinned host store, ``lru`` at ``slots`` (the backends share that store)."""
    return MoEOffloadedMixtral.from_pretrained(ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
                                               offload=OffloadConfig(policy="lru", gpu_expert_slots=slots),
                                               cuda_graphs=False)  # eager first: graphs_rows captures itself


def host_budgets_gb(plan: dict, fractions: list[float], readers: int = OffloadConfig.disk_readers) -> list[float]:
    """``host_memory_gb`` values that leave room for about ``fraction`` of all experts once what else the host
    budget holds is counted (weights + KV cache on a CPU device; each reader's staging buffer, ~ one expert)."""
    row = plan["expert_bytes"]
    other = plan["host_reserved"] + readers * (row + 4096)
    return [round((other + f * plan["total_experts"] * row) / 2**30, 6) for f in fractions]


def graphs_rows(model, host, policy: str, slots: int | None, prompt, new_tokens: int, capture_factory,
                expected) -> tuple[list[dict], torch.Tensor]:
    """Eager then captured decode of one backend: three rows (``mode`` "eager", "cuda_graphs" and
    "cuda_graphs_experts_eager": the offload backend's device part left eager) and the eager tokens."""
    runner = model.runner
    eager_fn = getattr(runner.decode_fn, "inner", runner.decode_fn)
    runner.decode_fn = eager_fn
    install_backend(model, host, policy, slots, "auto")
    rows = []
    model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])  # warm-up: compile, cache
    row, eager_out = run_config(model, prompt, new_tokens, expected, eos_token_id=[])
    rows.append({"section": "cuda_graphs", "policy": policy, "slots": slots, "mode": "eager", **row})
    for mode, capture_experts in (("cuda_graphs", True), ("cuda_graphs_experts_eager", False)):
        try:
            graphs = model.capture_decode(capture_factory, capture_experts=capture_experts)
            reserved = _reserved(model.device)
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])  # captures
            pools = pool_memory(model, graphs, reserved, prompt, new_tokens)
            before = graphs.captures
            row, out = run_config(model, prompt, new_tokens, eager_out, eos_token_id=[])
            row.update(captures=graphs.captures, captures_during_timed_run=graphs.captures - before,
                       refused=graphs.refused, pieces=len(graphs.step.replays) if graphs.step else 0,
                       tokens_equal_resident=None if expected is None
                       else bool(torch.equal(out.cpu(), expected.cpu())),
                       speedup_vs_eager=(row["tok_per_s"] / rows[0]["tok_per_s"])
                       if row["tok_per_s"] and rows[0]["tok_per_s"] else None, **pools)
            row["tokens_equal_eager"] = row.pop("tokens_equal_reference")
            rows.append({"section": "cuda_graphs", "policy": policy, "slots": slots, "mode": mode, **row})
        except Exception as exc:  # the eager row stands; the graphs' failure is the result
            rows.append({"section": "cuda_graphs", "policy": policy, "slots": slots, "mode": mode,
                         "error": f"{type(exc).__name__}: {exc}"})
        finally:
            runner.decode_fn = eager_fn
    return rows, eager_out


def _reserved(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_reserved(device)


def pool_memory(model, graphs, reserved_before: int | None, prompt, new_tokens: int) -> dict:
    """What the captured steps took from the device (reserved memory's growth over the capturing generate: the
    pools plus the kept KV cache) against the memory plan's estimate for that many steps
    (``memory.graph_pool_bytes``): the estimate ``from_pretrained(cuda_graphs=True)`` reserves, checked."""
    from moeflow.engine import generate, memory

    cfg = model.config
    context = generate.cache_length(prompt.shape[1] + new_tokens, cfg.max_position_embeddings)
    steps = len(graphs.steps)
    estimate = memory.graph_pool_bytes(cfg, model.dtype, context, prompt.shape[0], cfg.num_experts_per_tok,
                                       cfg.intermediate_size, steps=steps)
    kv = memory.kv_cache_bytes(cfg, model.dtype, context, prompt.shape[0])
    after = _reserved(model.device)
    growth = None if reserved_before is None else after - reserved_before
    return {"graph_steps": steps, "graph_pool_estimate_bytes": estimate, "kv_cache_bytes": kv,
            "reserved_growth_bytes": growth,
            "pool_estimate_covers": None if growth is None else estimate >= growth - kv}


def disk_row(ckpt: Path, device, dtype, kernels: str, slots: int, host_gb: float, prompt, new_tokens: int,
             in_ram, resident) -> dict:
    """One load with the disk tier at ``host_gb``; the timed decode after the checkpoint's pages were dropped."""
    model = MoEOffloadedMixtral.from_pretrained(
        ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
        offload=OffloadConfig(policy="lru", gpu_expert_slots=slots, host_memory_gb=host_gb))
    try:
        backend, host = model.experts, model.experts.host
        model.generate(prompt[:, :8], max_new_tokens=2, do_sample=False, eos_token_id=[])  # warm-up
        dropped = drop_page_cache(ckpt)
        row, out = run_config(model, prompt, new_tokens, in_ram, eos_token_id=[])  # (its stats.reset() zeroes the
        # disk tier's counters too, model.stats.disk: what they hold after it is the timed run's)
        row["tokens_equal_in_ram_lru"] = row.pop("tokens_equal_reference")
        row["tokens_equal_resident"] = None if resident is None else bool(torch.equal(out.cpu(), resident.cpu()))
        steps = new_tokens
        row.update(section="disk", policy="lru", slots=slots, host_memory_gb=host_gb, on_disk=host.on_disk,
                   host_pinned=host.pinned, page_cache_dropped=dropped,
                   transport=getattr(getattr(backend, "transport", None), "name", "none"),
                   host_experts=getattr(host, "capacity", None), expert_bytes=host.fmt.nbytes)
        if host.on_disk:
            after = host.stats.as_dict()
            disk = after["bytes_read"]
            row.update(disk_bytes=disk, disk_bytes_per_token=disk / steps,
                       disk_stall_ms_per_token=after["stall_s"] * 1e3 / steps, disk_stats=after)
        return row
    finally:
        model.close()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def summary(r: dict) -> str:
    head = f"{r['section']:>11} {r['policy']:>8} slots={r.get('slots')}"
    if "error" in r:
        return f"{head} {r.get('mode') or r.get('host_memory_gb')}: error {r['error']}"
    tok = f"{r['tok_per_s']:.2f} tok/s" if r.get("tok_per_s") else "no decode time"
    if r["section"] == "cuda_graphs":
        extra = (f", x{r['speedup_vs_eager']:.2f} vs eager, tokens = eager: {r['tokens_equal_eager']}, refused: "
                 f"{r['refused']}" if r["mode"] != "eager" else "")
        return f"{head} {r['mode']:>25}: {tok}{extra}"
    per_tok = r.get("disk_bytes_per_token")
    disk = f", {per_tok / 2**20:.1f} MiB/token from disk" if per_tok is not None else ", all in host memory"
    return (f"{head} host {r['host_memory_gb']} GB ({r['host_experts']} experts, pinned {r['host_pinned']}, "
            f"{r['transport']}): {tok}{disk}, tokens = in-RAM lru: {r['tokens_equal_in_ram_lru']}, "
            f"= resident: {r['tokens_equal_resident']}")


def write_report(out_dir: Path, result: dict) -> None:
    (out_dir / "engine_results.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# moeflow engine on {result['env'].get('device_name', 'cpu')}", "",
             "| section | policy | slots | mode / host GB | tok/s | x eager | MiB disk/token | pinned | "
             "tokens equal | refused / error |", "|" + "---|" * 10]
    for r in result["runs"]:
        mode = r.get("mode") or r.get("host_memory_gb")
        ratio = f"{r['speedup_vs_eager']:.2f}" if r.get("speedup_vs_eager") else ""
        if "error" in r:
            lines.append(f"| {r['section']} | {r['policy']} | {r.get('slots')} | {mode} |||||| {r['error'][:80]} |")
            continue
        equal = r.get("tokens_equal_eager", r.get("tokens_equal_in_ram_lru"))
        per_tok = r.get("disk_bytes_per_token")
        lines.append(f"| {r['section']} | {r['policy']} | {r.get('slots')} | {mode} | {r.get('tok_per_s') or 0:.2f} | "
                     f"{ratio} | {'' if per_tok is None else f'{per_tok / 2**20:.1f}'} | "
                     f"{r.get('host_pinned', '')} | {equal} | {r.get('refused') or ''} |")
    (out_dir / "engine_results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--slots", type=int, default=None, help="GPU expert slots of the lru runs (default 64; tiny 5)")
    ap.add_argument("--host-fractions", default="0.375,0.625",
                    help="disk tier: host_memory_gb holding these fractions of all experts (comma list)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--sections", default="cuda_graphs,disk")
    ap.add_argument("--time-budget-s", type=float, default=360.0, help="stop starting measurements after this")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_engine"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, dtype, config, kernels, group, ckpt = mixtral_setup(args)
    if args.tiny:
        slots, prompt_len, new_tokens = args.slots or 5, args.prompt_len or 8, args.new_tokens or 6
        capture_factory = cpu_capture_factory()
    else:
        slots, prompt_len, new_tokens = args.slots or 64, args.prompt_len or 64, args.new_tokens or 32
        capture_factory = None  # CUDA graphs
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"env": run_env(device, argv), "config": config, "runs": []}
    t0 = time.perf_counter()
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    result["checkpoint"] = {"path": str(ckpt), "write_s": time.perf_counter() - t0, "bytes": checkpoint_bytes(ckpt)}
    write_report(args.out, result)
    prompt = torch.randint(3, config["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    sections = args.sections.split(",")
    L, E = config["num_hidden_layers"], config["num_local_experts"]

    def record(row: dict) -> None:
        result["runs"].append(row)
        write_report(args.out, result)
        print(summary(row), flush=True)

    def over_budget(section: str, policy: str, what) -> bool:
        if time.perf_counter() - t_start <= args.time_budget_s:
            return False
        record({"section": section, "policy": policy, "slots": slots, "mode": what, "error": "skipped: time budget"})
        return True

    resident = in_ram = None
    if "cuda_graphs" in sections:
        t0 = time.perf_counter()
        model = load_in_ram(ckpt, device, dtype, kernels, slots)
        result["checkpoint"]["load_s"] = time.perf_counter() - t0
        result["memory_plan"] = model.memory_plan().as_dict()
        host = model.experts.host
        fits = device.type == "cpu" or L * E * host.fmt.nbytes < 0.8 * torch.cuda.get_device_properties(
            device).total_memory
        for policy, n in ([("resident", L * E)] if fits else []) + [("lru", slots)]:
            if over_budget("cuda_graphs", policy, "eager"):
                continue
            try:
                rows, eager_out = graphs_rows(model, host, policy, n, prompt, new_tokens, capture_factory, resident)
            except Exception as exc:  # one failing measurement must not lose the others
                record({"section": "cuda_graphs", "policy": policy, "slots": n, "error": f"{type(exc).__name__}: "
                        f"{exc}"})
                continue
            if policy == "resident":
                resident = eager_out
            else:
                in_ram = eager_out
            for row in rows:
                record(row)
        model.close()
        host.close()  # the backends shared it (none owned it after the swaps): unregister its pages before freeing
        del model, host
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "disk" in sections:
        if "memory_plan" not in result:
            model = load_in_ram(ckpt, device, dtype, kernels, slots)
            result["memory_plan"] = model.memory_plan().as_dict()
            model.close()
        for gb in host_budgets_gb(result["memory_plan"], [float(f) for f in args.host_fractions.split(",")]):
            if over_budget("disk", "lru", gb):
                continue
            try:
                row = disk_row(ckpt, device, dtype, kernels, slots, gb, prompt, new_tokens, in_ram, resident)
            except Exception as exc:  # e.g. a budget below the tier's minimum: the reason is the result
                row = {"section": "disk", "policy": "lru", "slots": slots, "host_memory_gb": gb,
                       "error": f"{type(exc).__name__}: {exc}"}
            record(row)
    result["total_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    print((args.out / "engine_results.md").read_text())
    return result


if __name__ == "__main__":
    main()
