"""GPU hybrid benchmark: decode tok/s with cpu_compute "never" vs "auto" at a 12 GB and a 16 GB budget.

On a GPU host with the synthetic Mixtral-8x7B AWQ checkpoint (exact shapes, random weights; written by
``common.checkpoint.write_synthetic_awq_checkpoint`` in the same run because a lent machine starts bare):

1. loads it once (experts into the pinned host store); the CPU int4 forms are built on the first hybrid
   configuration and shared by the later ones (they live in the host store), and the cost model's rates
   are calibrated once (cached on disk) and recorded;
2. for each budget (GB of device memory for the whole model: non-expert weights + KV cache + expert slots)
   and policy (``lru``, ``mixtral-offloading`` — the predictive preset — and ``fiddler``): TTFT, decode
   tokens/s, hit rates, experts computed on the CPU, CPU seconds, races, bytes moved, and whether the tokens
   equal the first run's (CPU experts round activations to bf16, so equality is expected, not guaranteed);
3. writes ``hybrid_results.json`` + ``hybrid_results.md`` after every configuration, with the ratio
   auto / never per policy and budget (issue target: >= 1.5x at 12 GB).

``--tiny`` runs the same code on the CPU with a tiny AWQ checkpoint (slot counts instead of GB budgets).

    python -m benchmarks.gpu.hybrid --out benchmarks/results/gpu_hybrid          # on a GPU
    python -m benchmarks.gpu.hybrid --tiny --out /tmp/hybrid_tiny                  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, TINY, write_synthetic_awq_checkpoint
from benchmarks.gpu.offload import _free, _sync, run_config
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.loading import non_expert_bytes
from moeflow.offload import OffloadedExperts, create_expert_backend, min_slots

GiB = 2**30
POLICIES = ("lru", "mixtral-offloading", "fiddler")
MODES = ("never", "auto")
KV_TOKENS = 4096  # context the KV cache is sized for inside the budget (as from_pretrained assumes)


def slots_for_budget(model: MoEOffloadedMixtral, fmt, budget_gb: float) -> int:
    """Expert slots that fit in ``budget_gb`` after the non-expert weights and a KV cache of KV_TOKENS."""
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * KV_TOKENS * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return int((budget_gb * GiB - non_expert_bytes(model.model) - kv) // fmt.nbytes)


def install(model: MoEOffloadedMixtral, host, policy: str, slots: int, mode: str, transport: str,
            overrides: dict) -> OffloadedExperts:
    """Swap the model's expert backend, sharing the filled host store (and its CPU int4 forms)."""
    _free(model)
    cfg = model.config
    config = OffloadConfig(policy=policy, gpu_expert_slots=slots, transport=transport,
                           cpu_compute=None if (policy == "fiddler" and mode == "auto") else mode, **overrides)
    backend = create_expert_backend(
        config, fmt=host.fmt, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok, device=model.device, kernels_backend=model.kernels,
        gates=[b.gate for b in model.model.moe_blocks], reserved_bytes=0, stats=model.stats,
        host_store=host,
    )
    backend.finish_loading()
    model.use_backend(backend)
    _sync(model.device)
    return backend


def write_report(out_dir: Path, result: dict) -> None:
    (out_dir / "hybrid_results.json").write_text(json.dumps(result, indent=1, default=str))
    env = result["env"]
    lines = [f"# moeflow hybrid benchmark ({env.get('device_name', 'cpu')}, {env.get('cpu_count')} CPU cores)", ""]
    if result.get("rates"):
        r = result["rates"]
        lines += [f"Cost-model rates ({r['source']}): H2D {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, CPU expert "
                  f"{r['cpu_expert_s'] * 1e3:.2f} ms for one token + {r['cpu_token_s'] * 1e3:.2f} ms per further "
                  f"token; CPU int4 forms built in {r.get('build_s', 0):.1f} s, "
                  f"{r.get('cpu_store_bytes', 0) / GiB:.2f} GiB of host RAM", ""]
    lines += ["| budget | slots | policy | cpu_compute | TTFT s | decode tok/s | decode hit | CPU experts | CPU s | "
              "races (CPU won) | MiB moved | tokens = first |", "|" + "---|" * 12]
    for r in result["runs"]:
        head = f"| {r['budget']} | {r['slots']} | {r['policy']} | {r['mode']} |"
        if "error" in r:
            lines.append(head + f" error: {r['error']} |" + " |" * 7)
            continue
        st = r["stats"]
        cpu_n = st["prefill"]["cpu_experts"] + st["decode"]["cpu_experts"]
        cpu_s = st["prefill"]["cpu_s"] + st["decode"]["cpu_s"]
        races = st["prefill"]["cpu_races"] + st["decode"]["cpu_races"]
        wins = st["prefill"]["cpu_race_wins"] + st["decode"]["cpu_race_wins"]
        moved = (st["prefill"]["bytes_h2d"] + st["decode"]["bytes_h2d"]) / 2**20
        lines.append(head + f" {r['ttft_s']:.3f} | {r['tok_per_s'] or 0:.2f} | {st['decode']['hit_rate']:.0%} | "
                     f"{cpu_n} | {cpu_s:.2f} | {races} ({wins}) | {moved:.0f} | {r['tokens_equal_reference']} |")
    ratios = result.get("auto_over_never", {})
    if ratios:
        lines += ["", "Decode tok/s, auto / never (target >= 1.5x at 12 GB):", ""]
        lines += [f"* {k}: {v:.2f}x" for k, v in ratios.items()]
    (out_dir / "hybrid_results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny AWQ checkpoint on the CPU (exercises the code)")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=None, help="write fewer layers (same shapes per layer)")
    ap.add_argument("--budgets", default=None, help="GB per run (default 12,16); with --tiny: slot counts")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--cpu-workers", type=int, default=1)
    ap.add_argument("--calibration-file", default=None)
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="stop starting configurations after this")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_hybrid"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if args.tiny:
        torch.set_num_threads(1)
        device, dtype, config, group = torch.device("cpu"), torch.float32, dict(TINY), 32
        budgets = [float(b) for b in (args.budgets or "3,6").split(",")]
        prompt_len, new_tokens = args.prompt_len or 8, args.new_tokens or 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        device, dtype, config, group = torch.device("cuda"), torch.float16, dict(MIXTRAL_8X7B), 128
        budgets = [float(b) for b in (args.budgets or "12,16").split(",")]
        prompt_len, new_tokens = args.prompt_len or 64, args.new_tokens or 32
    if args.layers:
        config["num_hidden_layers"] = args.layers
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny' if args.tiny else 'mixtral-8x7b'}-awq-L{config['num_hidden_layers']}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "argv": sys.argv[1:] if argv is None else argv, "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory)
    result: dict = {"env": env, "config": config, "runs": [], "auto_over_never": {}}

    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    smallest = min_slots(OffloadConfig(), k)
    model = MoEOffloadedMixtral.from_pretrained(
        ckpt, device=device, dtype=dtype, kernels="torch" if args.tiny else "auto", progress=False,
        offload=OffloadConfig(policy="lru", gpu_expert_slots=smallest, transport=args.transport),
    )
    host = model.experts.host
    prompt = torch.randint(3, config["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt[:, :4], max_new_tokens=2, do_sample=False)  # warm-up, not measured
    overrides = {"cpu_workers": args.cpu_workers, "calibration_file": args.calibration_file}

    expected = None
    for budget in budgets:
        slots = int(budget) if args.tiny else slots_for_budget(model, host.fmt, budget)
        slots = max(smallest, min(slots, L * E))
        for policy in args.policies.split(","):
            tps = {}
            for mode in args.modes.split(","):
                run = {"budget": budget, "slots": slots, "policy": policy, "mode": mode}
                if policy == "fiddler" and mode == "never":
                    continue  # fiddler computes every unplaced expert on the CPU by definition
                if time.perf_counter() - t_start > args.time_budget_s:
                    result["runs"].append({**run, "error": "skipped: time budget"})
                    continue
                try:
                    backend = install(model, host, policy, slots, mode, args.transport, overrides)
                    if backend.cpu is not None and "rates" not in result:
                        result["rates"] = {**backend.cpu.rates.as_dict(), "source": backend.cpu.rates_source,
                                           "build_s": backend.cpu.build_s, "cpu_store_bytes": host.cpu_nbytes}
                    row, out = run_config(model, prompt, new_tokens, expected)
                except Exception as exc:  # one failing configuration must not lose the others
                    result["runs"].append({**run, "error": f"{type(exc).__name__}: {exc}"})
                    write_report(args.out, result)
                    continue
                expected = out if expected is None else expected
                result["runs"].append({**run, **row})
                tps[mode] = row["tok_per_s"]
                write_report(args.out, result)
                print(f"{budget:>5} {policy:>20} {mode:>6}: {row['summary']}", flush=True)
            if tps.get("never") and tps.get("auto"):
                result["auto_over_never"][f"{policy} @ {budget:g}{'' if args.tiny else ' GB'}"] = \
                    tps["auto"] / tps["never"]
    result["total_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    if isinstance(model.experts, OffloadedExperts):
        model.experts.close()
    print((args.out / "hybrid_results.md").read_text())
    return result


if __name__ == "__main__":
    main()
