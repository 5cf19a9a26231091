"""Where a moeflow ``device="cpu"`` decode step goes: torch profiler summary on the peer benchmark's model.

Loads the AWQ synthetic Mixtral (``run_peers.py`` writes it), generates a few tokens under
``torch.profiler`` with each module region labelled through forward hooks (no change to the model code),
and writes, per decode step: the count and self time of every aten op, the same split by region
(attention, router, experts, norms, lm_head, embedding, outside any region), and the wall time per
decode step measured without the profiler.

    python -m benchmarks.peers.profile_cpu_decode --model /tmp/peers/awq --out benchmarks/results/peers/profile_before
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP_LABELS = ("decode_step", "prefill_step")
LAYER = "layer (one-call attention half, residual add)"
REGIONS = ("embedding", "attention", "norms", "router", "moe (experts + combine)", "lm_head", LAYER)
WATCH = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::copy_", "aten::_to_copy",
         "aten::to", "aten::nonzero", "aten::index", "aten::index_put_", "aten::unique_dim", "aten::_unique2",
         "aten::cat", "aten::empty", "aten::_weight_int4pack_mm_for_cpu", "aten::scaled_dot_product_attention")


def label_regions(model) -> list:
    """Forward hooks that open a profiler range per region; returns the hook handles."""
    handles, stack = [], []

    def add(module, name_fn):
        def pre(m, args):
            rf = record_function(name_fn(args))
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out):
            stack.pop().__exit__(None, None, None)

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    inner = model.model
    add(inner, lambda args: "decode_step" if args[0].shape[1] == 1 else "prefill_step")
    add(inner.embed_tokens, lambda a: "embedding")
    add(inner.norm, lambda a: "norms")
    add(inner.lm_head, lambda a: "lm_head")
    for layer in inner.layers:
        add(layer, lambda a: LAYER)  # what runs in no module below: the engine's one-call attention half (cpu_step)
        add(layer.self_attn, lambda a: "attention")
        add(layer.input_layernorm, lambda a: "norms")
        add(layer.post_attention_layernorm, lambda a: "norms")
        add(layer.block_sparse_moe, lambda a: "moe (experts + combine)")
        add(layer.block_sparse_moe.gate, lambda a: "router")
    return handles


def count_native_calls() -> collections.Counter | None:
    """Count the calls into moeflow's own CPU kernels from now on (None where this moeflow has none)."""
    try:
        from moeflow.kernels.cpu import native as cpu_native
    except ImportError:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    calls: collections.Counter = collections.Counter()

    class Counting:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return lambda *a: calls.update([name]) or fn(*a)

    cpu_native.set_library(Counting())
    return calls


def summarize(events, n_steps: int, n_layers: int) -> dict:
    """Per decode step: aten op counts and self times, overall and per region."""
    ops = collections.Counter()
    self_us = collections.Counter()
    by_region: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    region_self_us = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        region, step, p = None, None, e.cpu_parent
        while p is not None:
            if p.name in STEP_LABELS:
                step = p.name
                break
            if region is None and p.name in REGIONS:
                region = p.name
            p = p.cpu_parent
        if step != "decode_step":
            continue
        region = region or "outside any region"
        ops[e.name] += 1
        self_us[e.name] += e.self_cpu_time_total
        by_region[region][e.name] += 1
        region_self_us[region] += e.self_cpu_time_total
    per = 1.0 / n_steps
    return {
        "decode_steps": n_steps, "layers": n_layers,
        "aten_ops_per_step": sum(ops.values()) * per,
        "watched_ops_per_step": {k: ops[k] * per for k in WATCH if ops[k]},
        "top_ops_by_self_time_ms_per_step": {k: round(v * per / 1e3, 3) for k, v in self_us.most_common(15)},
        "top_ops_by_count_per_step": {k: v * per for k, v in ops.most_common(15)},
        "regions": {
            r: {"self_ms_per_step": round(region_self_us[r] * per / 1e3, 3),
                "ops_per_step": sum(by_region[r].values()) * per,
                "watched_ops_per_step": {k: by_region[r][k] * per for k in WATCH if by_region[r][k]}}
            for r in sorted(by_region, key=lambda r: -region_self_us[r])
        },
    }


def markdown(s: dict) -> str:
    lines = [f"Decode step of moeflow `device=\"cpu\"` ({s['kernels']}), {s['decode_steps']} profiled steps, "
             f"{s['layers']} layers. Wall time per decode step without the profiler: "
             f"{s['wall_ms_per_step']:.1f} ms ({1e3 / s['wall_ms_per_step']:.1f} tok/s). "
             f"Aten ops per step: {s['aten_ops_per_step']:.0f}." +
             (f" Calls into moeflow's own CPU kernels per step (not aten ops): "
              f"{s['native_kernel_calls_per_step']}." if s.get("native_kernel_calls_per_step") else ""), "",
             f"uptime before: `{s.get('uptime_before')}`  ", f"uptime after: `{s.get('uptime_after')}`", "",
             "| region | self ms / step (profiled) | aten ops / step | per layer | mm / copy_ / _to_copy per step |",
             "|---|---|---|---|---|"]
    for r, v in s["regions"].items():
        w = v["watched_ops_per_step"]
        per_layer = v["ops_per_step"] / s["layers"] if r not in ("lm_head", "embedding", "outside any region") \
            else v["ops_per_step"]
        mm = w.get("aten::mm", 0) + w.get("aten::addmm", 0) + w.get("aten::bmm", 0)
        lines.append(f"| {r} | {v['self_ms_per_step']:.2f} | {v['ops_per_step']:.0f} | {per_layer:.1f} | "
                     f"{mm:.0f} / {w.get('aten::copy_', 0):.0f} / {w.get('aten::_to_copy', 0):.0f} |")
    lines += ["", "| aten op | self ms / step | count / step |", "|---|---|---|"]
    for k, v in s["top_ops_by_self_time_ms_per_step"].items():
        lines.append(f"| {k} | {v:.2f} | {s['top_ops_by_count_per_step'].get(k, '')} |")
    return "\n".join(lines)


def main() -> None:
    from moeflow import MoEOffloadedMixtral

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the AWQ synthetic checkpoint")
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-bits", type=int, default=None, help="from_pretrained(attention_bits=...)")
    ap.add_argument("--lm-head-bits", type=int, default=8, help="from_pretrained(lm_head_bits=...)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    extra = {} if args.attention_bits is None else {"attention_bits": args.attention_bits}
    if args.lm_head_bits != 8:
        extra["lm_head_bits"] = args.lm_head_bits
    model = MoEOffloadedMixtral.from_pretrained(args.model, device="cpu", **extra)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=args.steps + 1, do_sample=False, eos_token_id=[])
    with torch.inference_mode():
        model.generate(ids, **gen)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **gen)
        wall = model.stats.tpot_s
        handles = label_regions(model)
        native_calls = count_native_calls()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(ids, **gen)
        for h in handles:
            h.remove()
        total_calls = dict(native_calls or {})
        if native_calls is not None:  # the prefill's share, to subtract
            native_calls.clear()
            model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=[])
    s = summarize(prof.events(), args.steps, model.config.num_hidden_layers)
    if native_calls is not None:  # moeflow's own kernels are ctypes calls, not aten ops: counted here
        s["native_kernel_calls_per_step"] = {k: (v - native_calls[k]) / args.steps for k, v in total_calls.items()}
    s.update(kernels=model.kernels, wall_ms_per_step=wall * 1e3, uptime_before=uptime_before,
             uptime_after=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
             generate_wall_s=time.perf_counter() - t0, torch=torch.__version__, threads=args.threads,
             attention_bits=args.attention_bits, lm_head_bits=args.lm_head_bits)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(s, indent=1))
    args.out.with_suffix(".md").write_text(markdown(s) + "\n")
    print(markdown(s))


if __name__ == "__main__":
    main()
