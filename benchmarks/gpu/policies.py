"""GPU policy benchmark: decode time per token and TTFT of every offload policy at one slot budget on the
synthetic Mixtral-8x7B AWQ checkpoint, with predictors trained in the same run on a trace of that checkpoint.

One run (a lent GPU machine starts bare):

1. writes (or reuses) the synthetic checkpoint of ``gpu/offload.py`` (exact Mixtral-8x7B shapes, ~24.6 GB);
2. loads it once; records a routing trace (MoE inputs, embeddings) of ``--trace-prompts`` random prompts with
   every expert resident when that fits (else the largest budget), and trains the ``duoserve`` and ``promoe``
   predictors on it (time-capped), writing them to ``<checkpoint>/predictors/`` where the presets look;
3. measures each predictor's per-layer overhead on the device (observe + propose for one decode token,
   CUDA events), as a share of the measured decode step;
4. for every policy at ``--slots`` (default 64 of 256 experts): TTFT, decode time per token, hit rates,
   bytes moved, stall, peak memory, and whether the tokens equal ``resident``'s. Policies share the one host
   store (nothing is reloaded).

Results go to ``--out`` (``policies_results.json`` + ``policies_results.md``) after every configuration.
``--tiny`` runs the same code on the CPU with a tiny 4-layer checkpoint (tests/test_policies_bench.py).

    python -m benchmarks.gpu.policies --checkpoint /tmp/moeflow-mixtral-8x7b-awq \
        --out benchmarks/results/gpu_policies
    python -m benchmarks.gpu.policies --tiny --out /tmp/policies_tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, TINY, checkpoint_bytes, write_synthetic_awq_checkpoint
from benchmarks.gpu.offload import _free, _sync, run_config
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.moe import ResidentExperts
from moeflow.offload import POLICY_TABLE, create_expert_backend, min_slots

POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "duoserve", "promoe", "finemoe", "expertflow",
            "auto")


def install(model: MoEOffloadedMixtral, host, policy: str, slots: int, transport: str, ckpt: Path) -> object:
    """``policy`` at ``slots`` on the shared host store; predictor presets find their files in ``ckpt``."""
    _free(model)
    cfg, device = model.config, model.device
    if policy == "resident":
        backend = ResidentExperts(host.fmt, cfg.num_hidden_layers, cfg.num_local_experts, device, model.kernels)
        backend.pool.buffer.copy_(host.buffer)
    else:
        backend = create_expert_backend(
            OffloadConfig(policy=policy, gpu_expert_slots=slots, transport=transport), fmt=host.fmt,
            num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
            device=device, kernels_backend=model.kernels, gates=[b.gate for b in model.model.moe_blocks],
            reserved_bytes=0, stats=model.stats, host_store=host, checkpoint_dir=ckpt,
        )
        backend.finish_loading()
    model.use_backend(backend)
    _sync(device)
    return backend


def train_predictors(model, ckpt: Path, prompts: list[list[int]], new_tokens: int, max_seconds: float,
                     epochs: int) -> dict:
    """Trace ``prompts`` on ``model`` (whatever backend it has), train duoserve and promoe, save them."""
    from moeflow.offload.predictors import evaluate_held_out, train_predictor
    from moeflow.tools.record import record_trace

    t0 = time.perf_counter()
    trace = record_trace(model, prompts, new_tokens, hidden=True)
    info: dict = {"trace_tokens": len(trace), "trace_s": time.perf_counter() - t0}
    for kind in ("duoserve", "promoe"):
        t0 = time.perf_counter()
        pred = train_predictor(kind, trace, eval_fraction=0.2, epochs=epochs, max_seconds=max_seconds)
        pred.save(ckpt / "predictors" / f"{kind}.pt")
        held = evaluate_held_out(pred, trace)
        info[kind] = {"train_s": time.perf_counter() - t0, "recall": held["recall"], "exact_topk": held["exact_topk"],
                      "popularity_recall": held["popularity"]["recall"], "distance": pred.distance}
    return info


def predictor_overhead(ckpt: Path, cfg, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """Per-layer time of observe + propose for one decode token (device time with CUDA events on a GPU)."""
    from moeflow.offload.predictors import ModelShape, load_predictor

    shape = ModelShape.from_config(cfg)
    out = {}
    for kind in ("duoserve", "promoe"):
        pred = load_predictor(ckpt / "predictors" / f"{kind}.pt", expect=shape).to(device)
        L, H, E, k = shape.num_layers, shape.hidden_size, shape.num_experts, shape.top_k
        x = torch.randn(1, H, device=device, dtype=dtype)
        probs = torch.softmax(torch.randn(1, E, device=device), -1)
        ids = torch.topk(probs, k).indices.to(torch.int32)

        def one_token(pred=pred, x=x, probs=probs, ids=ids, layers=L) -> None:
            for layer in range(layers):
                pred.observe_and_propose(layer, x, probs, ids)

        one_token()  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            one_token()
        _sync(device)
        out[kind] = {"per_layer_ms": (time.perf_counter() - t0) / reps / L * 1e3}
    return out


def write_report(out_dir: Path, result: dict) -> None:
    (out_dir / "policies_results.json").write_text(json.dumps(result, indent=1, default=str))
    env = result["env"]
    lines = [f"# moeflow policies at {result.get('slots')} slots ({env.get('device_name', 'cpu')})", ""]
    pr = result.get("predictors") or {}
    for kind in ("duoserve", "promoe"):
        if kind in pr:
            lines.append(f"- {kind}: held-out recall {pr[kind]['recall']:.1%} (popularity "
                         f"{pr[kind]['popularity_recall']:.1%}), trained in {pr[kind]['train_s']:.0f} s")
    for kind, o in (result.get("overhead") or {}).items():
        share = o.get("share_of_decode_step")
        lines.append(f"- {kind} overhead per layer: {o['per_layer_ms']:.3f} ms"
                     + (f" ({share:.1%} of a decode step, if not hidden)" if share is not None else ""))
    lines += ["", "| policy | ran as | TTFT s | decode ms/token | tok/s | decode hit | MiB moved | stall ms | "
              "peak GiB | tokens = resident |", "|" + "---|" * 10]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['policy']} | error: {r['error']} |" + " |" * 8)
            continue
        st = r["stats"]
        moved = (st["prefill"]["bytes_h2d"] + st["decode"]["bytes_h2d"]) / 2**20
        stall = (st["prefill"]["stall_s"] + st["decode"]["stall_s"]) * 1e3
        lines.append(
            f"| {r['policy']} | {r['ran_as']} | {r['ttft_s']:.3f} | {(r['tpot_s'] or 0) * 1e3:.1f} | "
            f"{r['tok_per_s'] or 0:.2f} | {st['decode']['hit_rate']:.0%} | {moved:.0f} | {stall:.0f} | "
            f"{(r['peak_gpu_bytes'] or 0) / 2**30:.2f} | {r['tokens_equal_reference']} |"
        )
    (out_dir / "policies_results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on the CPU (exercises the code)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="where the synthetic checkpoint is (or goes)")
    ap.add_argument("--slots", type=int, default=None, help="the one slot budget (default 64; --tiny: 8)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="unregistered names are skipped")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--trace-prompts", type=int, default=None)
    ap.add_argument("--train-seconds", type=float, default=None, help="time cap per predictor")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="stop starting configurations after this")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_policies"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if args.tiny:
        torch.set_num_threads(1)
        device, dtype, config, kernels, group = torch.device("cpu"), torch.float32, dict(TINY), "torch", 32
        config["num_hidden_layers"] = 4
        slots, prompt_len, new_tokens = args.slots or 8, args.prompt_len or 12, args.new_tokens or 6
        n_trace, train_s, epochs = args.trace_prompts or 6, args.train_seconds or 5.0, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        device, dtype, config, kernels, group = torch.device("cuda"), torch.float16, dict(MIXTRAL_8X7B), "auto", 128
        slots, prompt_len, new_tokens = args.slots or 64, args.prompt_len or 128, args.new_tokens or 32
        n_trace, train_s, epochs = args.trace_prompts or 24, args.train_seconds or 60.0, 20
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny' if args.tiny else 'mixtral-8x7b'}-awq-L{config['num_hidden_layers']}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "argv": sys.argv[1:] if argv is None else argv}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory)
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    slots = max(min_slots(OffloadConfig(), k), min(slots, L * E))
    result: dict = {"env": env, "config": config, "slots": slots, "full_model_bytes": checkpoint_bytes(ckpt),
                    "runs": []}

    model = MoEOffloadedMixtral.from_pretrained(
        ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
        offload=OffloadConfig(policy="lru", gpu_expert_slots=min_slots(OffloadConfig(), k), transport=args.transport),
    )
    host = model.experts.host
    resident_bytes = L * E * host.fmt.nbytes
    fits = device.type == "cpu" or resident_bytes < 0.85 * torch.cuda.get_device_properties(device).total_memory

    # trace + predictors (every expert resident when it fits: the fastest way to route many tokens)
    gen = torch.Generator().manual_seed(1)
    trace_prompts = [torch.randint(3, config["vocab_size"], (prompt_len // 2,), generator=gen).tolist()
                     for _ in range(n_trace)]
    install(model, host, "resident" if fits else "lru", L * E if fits else max(slots, L * k), args.transport, ckpt)
    result["predictors"] = train_predictors(model, ckpt, trace_prompts, new_tokens, train_s, epochs)
    write_report(args.out, result)

    prompt = torch.randint(3, config["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt[:, :8], max_new_tokens=2, do_sample=False)  # warm-up (kernels, allocator)
    expected = None
    plan = (["resident"] if fits else []) + [p for p in args.policies.split(",") if p in POLICY_TABLE]
    for policy in plan:
        if time.perf_counter() - t_start > args.time_budget_s:
            result["runs"].append({"policy": policy, "error": "skipped: time budget"})
            continue
        try:
            backend = install(model, host, policy, L * E if policy == "resident" else slots, args.transport, ckpt)
            row, out = run_config(model, prompt, new_tokens, expected)
        except Exception as exc:  # one failing configuration must not lose the others
            result["runs"].append({"policy": policy, "error": f"{type(exc).__name__}: {exc}"})
            write_report(args.out, result)
            continue
        if expected is None:
            expected = out
        row.update(policy=policy, ran_as=getattr(backend, "policy_name", policy), slots=slots)
        result["runs"].append(row)
        write_report(args.out, result)
        print(f"{policy:>20}: {row['summary']}", flush=True)

    result["overhead"] = predictor_overhead(ckpt, model.config, device, dtype, reps=3 if args.tiny else 20)
    tpots = [r["tpot_s"] for r in result["runs"] if r.get("policy") == "resident" and r.get("tpot_s")]
    for o in result["overhead"].values():
        o["share_of_decode_step"] = (o["per_layer_ms"] * 1e-3 * L / tpots[0]) if tpots else None
    result["total_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    return result


if __name__ == "__main__":
    main()
