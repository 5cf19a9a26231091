"""Qwen3-MoE on ``device="cpu"``: decode with every layer in one native call (QK-norm inside ``mf_attn_step``)
against the per-layer step and the unfused step, A/B interleaved in one process (issues 39, 42). ``--family
qwen2_moe``: Qwen2-MoE (q/k/v bias in the attention half, shared expert with its sigmoid gate as one call).

A random checkpoint (transformers' own classes; ``--size`` tiny or medium) is written under ``--work``
and quantized to AWQ (experts and attention, group 32) once; one model is then switched rep after rep between

* ``one call``: ``mf_layers_step`` through every decoder layer (``NativeLayers`` enabled);
* ``per-layer``: the same fused ops, called layer by layer from Python (``layers_step.enabled = False``);
* ``as s15-int``: the step of this branch's base for Qwen3-MoE: native norms and router, but the attention (q, k,
  v as three linears, q_norm / k_norm modules, torch rotary and SDPA) unfused, the layers one by one: every
  attention's ``fused_qkv`` / ``fused_step`` off, as its QK-norm (Qwen2-MoE: its q/k/v bias) kept
  ``fuse_cpu_step`` from fusing it before, and the shared expert's three linears as modules;
* ``unfused``: ``set_cpu_step_fused(False)`` (torch norms and router too)

so the shared machine's load hits all alike. Reports, per mode, the median wall ms per decoded token (generate's
TPOT) and CPU ms per decoded token (CPU time of generate(tg + 1) minus generate(1), per token), ``uptime`` before
and after, and whether the three modes' greedy tokens are equal.

    python -m benchmarks.peers.cpu_qk_norm_ab --work /tmp/qk --size tiny --out benchmarks/results/peers/s15/qknorm_tiny
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report

SIZES = {
    "tiny": dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 vocab_size=1024),
    "medium": dict(hidden_size=1024, moe_intermediate_size=256, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                   vocab_size=8192),
}


def _checkpoint(work: Path, size: str, family: str) -> Path:
    """The AWQ checkpoint (experts and attention) of a random ``family`` model of ``size`` (written once)."""
    import transformers as tf

    from moeflow.tools.quantize import quantize_checkpoint

    name = f"{family.split('_')[0]}_{size}"
    awq = work / f"{name}_awq"
    if (awq / "config.json").exists():
        return awq
    torch.manual_seed(0)
    config, model_cls = {"qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                         "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM)}[family]
    extra = {"shared_expert_intermediate_size": 4 * SIZES[size]["moe_intermediate_size"]} \
        if family == "qwen2_moe" else {}
    model = model_cls(config(**SIZES[size], **extra, norm_topk_prob=True, max_position_embeddings=512))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.05)
    model.save_pretrained(work / f"{name}_fp32")
    return quantize_checkpoint(work / f"{name}_fp32", awq, group_size=32, quantize_attention=True,
                               progress=False)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    from moeflow import MoEModel
    from moeflow.engine.cpu_step import set_cpu_step_fused

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (the checkpoints)")
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--family", choices=["qwen3_moe", "qwen2_moe"], default="qwen3_moe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tg", type=int, default=32, help="decoded tokens per repetition")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    path = _checkpoint(args.work, args.size, args.family)
    before = uptime()
    model = MoEModel.from_pretrained(path, device="cpu", progress=False)
    if model.model.layers_step is None:
        raise SystemExit(f"{path}: no one-call layers on this tree (QK-norm / bias / shared expert not native)")
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def set_mode(mode: str) -> None:
        set_cpu_step_fused(model.model, mode != "unfused")
        model.model.layers_step.enabled = mode == "one call"
        if mode == "as s15-int":
            for layer in model.model.layers:
                layer.self_attn.fused_qkv = layer.self_attn.fused_step = False
                if layer.mlp.shared_expert is not None:
                    layer.mlp.shared_expert.native_step.native = False

    def run(n: int) -> tuple[float, float, torch.Tensor]:
        c0 = time.process_time()
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
        return time.process_time() - c0, model.stats.tpot_s, out

    modes = ("one call", "per-layer", "as s15-int", "unfused")
    samples: dict[str, dict[str, list[float]]] = {m: {"wall_ms": [], "cpu_ms": []} for m in modes}
    tokens = {}
    with torch.inference_mode():
        for mode in modes:  # warm-up, and each mode's greedy tokens
            set_mode(mode)
            tokens[mode] = run(args.tg)[2]
        for _ in range(args.reps):
            for mode in modes:
                set_mode(mode)
                one, _, _ = run(1)
                full, tpot, _ = run(args.tg + 1)
                samples[mode]["wall_ms"].append(tpot * 1e3)
                samples[mode]["cpu_ms"].append((full - one) / args.tg * 1e3)
    set_mode("one call")
    flags = subprocess.run(["grep", "-m1", "^flags", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    isa = " ".join(sorted(f for f in flags.split() if f.startswith(("avx", "fma", "f16c"))))
    res = {"family": args.family, "size": args.size, "shape": SIZES[args.size], "threads": args.threads,
           "prompt": args.prompt, "tg": args.tg, "reps": args.reps, "cpu": _cpu(), "isa": isa,
           "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "uptime_before": before,
           "uptime_after": uptime(), "samples": samples,
           "same_tokens": {m: bool(torch.equal(tokens[m], tokens["one call"])) for m in modes},
           "median": {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}}
    base = res["median"]["as s15-int"]["cpu_ms"]
    lines = [f"{args.family} ({args.size}: {SIZES[args.size]}) AWQ (experts + attention, group 32), moeflow "
             f"`device=\"cpu\"` decode, A/B interleaved ({args.reps} reps), {args.threads} thread(s), prompt "
             f"{args.prompt}, tg {args.tg}, {res['date']}.", "", f"CPU: {res['cpu']} ({isa})  ",
             f"uptime before: `{before}`  ", f"uptime after: `{res['uptime_after']}`  ",
             f"greedy tokens equal to the one call's: {res['same_tokens']}", "",
             "| mode | wall ms / token (median) | CPU ms / token (median) | tok/s from CPU ms | vs as s15-int "
             "(CPU ms) |",
             "|---|---|---|---|---|"]
    for name, m in res["median"].items():
        lines.append(f"| {name} | {m['wall_ms']:.2f} | {m['cpu_ms']:.2f} | {1e3 / m['cpu_ms']:.1f} | "
                     f"{base / m['cpu_ms']:.2f}x |")
    write_report(args.out, res, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
