"""Validate the simulator against the real runtime: simulated vs measured time per token, same trace and policy.

One run (a lent GPU machine starts bare, so everything happens in it):

1. writes the synthetic Mixtral-8x7B AWQ checkpoint of ``gpu/offload.py`` (``--layers`` for fewer layers)
   and loads it once;
2. records the routing trace (with hidden states) of one prompt: prefill plus greedy decoding. Greedy tokens
   are the same for every policy (the runtime's invariant), so every real run below follows this trace;
3. calibrates a hardware profile on this machine: copy bandwidth and latency of an expert region from the
   pinned host store; expert kernel time (1 and 64 tokens) and LM head with CUDA events
   (``moeflow.sim.bench``); the non-MoE layer time from the ``resident`` run (TPOT minus head and experts,
   per layer; its per-token part from TTFT); the per-layer host scheduling time from ``lru`` with every
   expert resident (TPOT minus resident TPOT, per layer). Only these two all-hit runs calibrate: the
   policies and budgets compared below are not fitted;
4. for each policy and slot budget: real TTFT / TPOT (``model.generate``) and simulated TTFT / TPOT
   (``moeflow.sim.simulate`` on the recorded trace with the calibrated profile), and their ratio
   (target: TPOT within 15 %).

Results go to ``--out`` (JSON + Markdown) after every configuration. ``--tiny`` runs the same code on the
CPU with a tiny checkpoint: it exercises the script, but the CPU's synchronous copies are not what the
simulator models, so its ratios mean nothing.

    python -m benchmarks.gpu.sim_validation --out benchmarks/results/gpu_sim_validation     # on a GPU
    python -m benchmarks.gpu.sim_validation --tiny --out /tmp/sim_validation_tiny             # anywhere
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, TINY, write_synthetic_awq_checkpoint
from benchmarks.gpu.offload import _sync, install_backend, run_config
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.offload import min_slots
from moeflow.sim import HardwareProfile, simulate
from moeflow.sim.bench import _timer
from moeflow.tools.record import record_trace
from moeflow.trace.synthetic import gate_modules

POLICIES = ("ondemand", "lru", "static", "mixtral-offloading")


def measure_copy(host, device: torch.device, chunks: int = 3) -> tuple[float, float]:
    """(GB/s, latency s) of copying one expert region of the host store into a device slot in ``chunks`` copies."""
    from moeflow.offload import chunk_ranges

    timed = _timer(device)
    nbytes = host.fmt.nbytes
    src = host.region(0, 0)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    nb = device.type == "cuda"
    ranges = chunk_ranges(nbytes, chunks)

    def chunked() -> None:
        for a, b in ranges:
            dst[a:b].copy_(src[a:b], non_blocking=nb)

    whole = timed(chunked, 10)
    small = timed(lambda: dst[:4096].copy_(src[:4096], non_blocking=nb), 30)
    return nbytes / max(whole - len(ranges) * small, 1e-9) / 1e9, small


def measure_expert(model, device: torch.device) -> tuple[float, float]:
    """(seconds for one expert on 1 token, extra seconds per token) with the model's kernels and one pool slot."""
    from moeflow import kernels
    from moeflow.kernels.pool import ExpertPool

    backend = model.experts
    fmt = backend.host.fmt
    pool = ExpertPool.allocate(fmt, 1, device)
    pool.buffer[0].copy_(backend.host.region(0, 0))
    dt = model.dtype if hasattr(model, "dtype") else torch.float16
    timed = _timer(device)

    def call(T: int):
        x = torch.randn(T, fmt.hidden_size, device=device, dtype=dt) * 0.1
        ids = torch.zeros(T, 1, dtype=torch.int32, device=device)
        w = torch.ones(T, 1, device=device)
        slot = torch.zeros(1, dtype=torch.int32, device=device)
        out = torch.empty(T, fmt.hidden_size, device=device, dtype=dt)
        return lambda: kernels.expert_forward(x, ids, w, pool, slot, out, None, model.kernels, validate=False)

    e1, e64 = timed(call(1), 10), timed(call(64), 5)
    return e1, max(0.0, (e64 - e1) / 63)


def calibrate(model, host, device, trace, resident: dict, all_hits: dict, prompt_len: int) -> HardwareProfile:
    cfg = model.config
    L, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    gbps, lat = measure_copy(host, device)
    e1, ept = measure_expert(model, device)
    head_w = model.lm_head.weight if hasattr(model, "lm_head") else None
    head = 0.0
    if head_w is not None:
        xh = torch.randn(1, head_w.shape[1], device=device, dtype=head_w.dtype)
        head = _timer(device)(lambda: xh @ head_w.T, 10)
    tpot, ttft = resident["tpot_s"], resident["ttft_s"]
    attn = max(0.0, (tpot - head - L * k * e1) / L)
    # prefill: per layer attn + attn_pt * P + sum over used experts (e1 + ept * n)
    pre = trace.phase_rows("prefill")
    expert_pre = 0.0
    for l in range(L):
        counts = torch.bincount(pre.topk_ids[:, l].reshape(-1).long(), minlength=cfg.num_local_experts)
        expert_pre += sum(e1 + ept * int(c) for c in counts.tolist() if c)
    attn_pt = max(0.0, (ttft - head - L * attn - expert_pre) / (L * prompt_len))
    sched = max(0.0, (all_hits["tpot_s"] - tpot) / L)
    return HardwareProfile(
        name=f"calibrated-{device.type}", h2d_gbps=gbps, expert_bytes=host.fmt.nbytes, h2d_latency_us=lat * 1e6,
        attn_ms=attn * 1e3, attn_ms_per_token=attn_pt * 1e3, expert_ms=e1 * 1e3, expert_ms_per_token=ept * 1e3,
        head_ms=head * 1e3, sched_ms=sched * 1e3, num_layers=L, num_experts=cfg.num_local_experts, top_k=k,
        description="calibrated by benchmarks/gpu/sim_validation.py from the resident and all-hit lru runs",
        measured=True,
    )


def write_report(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_validation.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# simulator vs measured ({result['env'].get('device_name', 'cpu')})", "",
             "| policy | slots | measured TPOT ms | simulated TPOT ms | sim / measured | measured TTFT ms | "
             "simulated TTFT ms | sim / measured |", "|" + "---|" * 8]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['slots']} | error: {r['error']} |" + " |" * 5)
            continue
        lines.append(f"| {r['policy']} | {r['slots']} | {r['measured_tpot_s'] * 1e3:.2f} | "
                     f"{r['sim_tpot_s'] * 1e3:.2f} | {r['tpot_ratio']:.3f} | {r['measured_ttft_s'] * 1e3:.1f} | "
                     f"{r['sim_ttft_s'] * 1e3:.1f} | {r['ttft_ratio']:.3f} |")
    if result.get("tiny"):
        lines += ["", "CPU --tiny run: exercises the script only; the CPU's synchronous copies are not what the "
                  "simulator models, so the ratios are meaningless."]
    (out / "sim_validation.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on the CPU (exercises the code)")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--budgets", default=None, help="comma-separated slot counts")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=480.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_sim_validation"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.tiny:
        torch.set_num_threads(1)
        device, dtype, config, kernels = torch.device("cpu"), torch.float32, dict(TINY), "torch"
        budgets = [int(b) for b in (args.budgets or "2,8").split(",")]
        prompt_len, new_tokens, group = args.prompt_len or 8, args.new_tokens or 4, 32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        device, dtype, config, kernels = torch.device("cuda"), torch.float16, dict(MIXTRAL_8X7B), "auto"
        budgets = [int(b) for b in (args.budgets or "16,64,128").split(",")]
        prompt_len, new_tokens, group = args.prompt_len or 128, args.new_tokens or 16, 128
    if args.layers:
        config["num_hidden_layers"] = args.layers
    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny' if args.tiny else 'mixtral-8x7b'}-awq-L{L}")
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    result: dict = {"env": env, "config": config, "tiny": args.tiny, "runs": []}
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    smallest = min_slots(OffloadConfig(), k)
    model = MoEOffloadedMixtral.from_pretrained(
        ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
        offload=OffloadConfig(policy="lru", gpu_expert_slots=smallest))
    host = model.experts.host
    prompt = torch.randint(3, config["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
    trace = record_trace(model, [prompt[0].tolist()], max_new_tokens=new_tokens, hidden=True)
    gates = gate_modules([l.block_sparse_moe.gate.weight.detach().float().cpu() for l in model.model.layers])

    install_backend(model, host, "resident", L * E, "auto")
    run_config(model, prompt, new_tokens, None)  # warm-up of this backend
    resident, expected = run_config(model, prompt, new_tokens, None)
    install_backend(model, host, "lru", L * E, "auto")
    all_hits, _ = run_config(model, prompt, new_tokens, expected)
    profile = calibrate(model, host, device, trace, resident, all_hits, prompt_len)
    result["profile"] = profile.as_dict()
    result["calibration"] = {"resident": {k_: resident[k_] for k_ in ("ttft_s", "tpot_s")},
                             "lru_all_slots": {k_: all_hits[k_] for k_ in ("ttft_s", "tpot_s")}}
    write_report(args.out, result)

    for slots in sorted({max(smallest, min(b, L * E)) for b in budgets}):
        for policy in args.policies.split(","):
            if time.perf_counter() - t_start > args.time_budget_s:
                result["stopped_early"] = True
                break
            row = {"policy": policy, "slots": slots}
            try:
                install_backend(model, host, policy, slots, "auto")
                real, out = run_config(model, prompt, new_tokens, expected)
                sim = simulate(trace, policy, slots, replace(profile), gates=gates, timeline=False)
                row.update(measured_ttft_s=real["ttft_s"], measured_tpot_s=real["tpot_s"], sim_ttft_s=sim.ttft_s,
                           sim_tpot_s=sim.tpot_s, tpot_ratio=sim.tpot_s / real["tpot_s"],
                           ttft_ratio=sim.ttft_s / real["ttft_s"],
                           measured_decode_hit=real["stats"]["decode"]["hit_rate"],
                           sim_decode_hit=sim.decode_hit_rate, tokens_equal_reference=real["tokens_equal_reference"],
                           within_15_percent=abs(sim.tpot_s / real["tpot_s"] - 1) <= 0.15)
            except Exception as e:  # one failing configuration must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
            result["runs"].append(row)
            write_report(args.out, result)
            _sync(device)
    result["wall_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    return result


if __name__ == "__main__":
    main()
