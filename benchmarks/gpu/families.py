"""GPU benchmark of the other families: Qwen3-30B-A3B-shaped AWQ and gpt-oss-120b-shaped MXFP4 checkpoints, and
slices of Qwen3-Next-80B-A3B, MiniMax-M2, DeepSeek-V3.2 and GLM-5 with AWQ experts (``common/family_writers.py``).

Issues 16 and 18: decode tok/s per GB budget, policy and ``cpu_compute`` mode on synthetic checkpoints with the
published layouts (a lent machine starts bare and has no network, so the run writes them itself):

* ``qwen3_moe`` (Qwen3-30B-A3B: 48 layers x 128 experts, top-8, hidden 2048, expert intermediate 768): experts
  AWQ 4-bit group 128 (``mlp.experts.E.{gate,up,down}_proj.{qweight,qzeros,scales}``), attention, router, norms
  and embeddings fp16; config.json as Qwen publishes it plus an AutoAWQ ``quantization_config``. ~17 GB.
* ``gpt_oss`` (gpt-oss-120b: hidden 2880, 128 experts, top-4, intermediate 2880, sink attention alternating
  sliding/full): experts MXFP4 as published (``mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`` uint8,
  biases bf16), ``quantization_config: mxfp4``. The full model (36 layers, ~61 GB) does not fit the 64 GiB disk
  beside anything else, so ``--layers`` (default 18, ~33 GB) writes fewer layers of the same shapes: decode time
  scales with the layer count only approximately, so the per-layer decode time is reported too, and the share of
  the experts a budget holds on the device is higher than the full model's at the same budget (18 layers: 24 GB
  still leaves a third of the experts off the device; with 12 it would hold them all). Loading repacks every
  MXFP4 expert's bits for the kernels (``mxfp4_reference.to_kernel_layout``, ~0.3 s per expert on 2 shared CPU
  cores here): ``load_s`` in the JSON says what it cost on the GPU host.
* ``qwen3_next`` (24 of 48 layers, ~23 GB), ``minimax_m2`` (10 of 62, ~22 GB), ``deepseek_v32`` (6 of 61: 3 dense +
  3 MoE, ~26 GB), ``glm_moe_dsa`` (GLM-5; 6 of 78: 3 dense + 3 MoE, ~23 GB):
  the layout ``moeflow quantize`` writes from the published checkpoints (AWQ experts, the rest bf16 under the names
  the family's loader reads); see ``common/family_writers.py``.

Weights are random bytes (no quantization of real floats), a few expert templates reused, so writing is fast;
the checkpoint goes under /tmp once and later runs reuse it. The model is loaded once (experts into the pinned
host store); each (budget, policy, cpu_compute) configuration swaps in a new expert backend on that store with
``OffloadConfig(gpu_memory_gb=budget)`` sized against the model's memory plan (non-expert weights, KV cache,
activations, workspaces), prefills a fixed prompt, decodes greedily and records TTFT, decode tok/s, hit rate,
bytes moved and whether the tokens equal the first configuration's (the exact-token invariant; CPU experts round
activations to bf16, so there equality is expected, not guaranteed). Policies that need a trained predictor file
(duoserve, promoe) are recorded as skipped with the library's reason. JSON + Markdown go to ``--out`` after every
configuration; ``--time-budget-s`` stops starting new ones. ``--tiny`` runs tiny shapes on the CPU (slot counts
instead of GB budgets).

    python -m benchmarks.gpu.families --family qwen3_moe --out benchmarks/results/gpu_families    # on a GPU
    python -m benchmarks.gpu.families --family gpt_oss --layers 18 --out benchmarks/results/gpu_families
    python -m benchmarks.gpu.families --family qwen3_next --out benchmarks/results/gpu_families  # 24 layers
    python -m benchmarks.gpu.families --tiny --family gpt_oss --out /tmp/families_tiny                # anywhere
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import family_writers
from benchmarks.common.checkpoint import random_awq_linear
from benchmarks.gpu.offload import _free, _sync, run_config
from moeflow import MoEModel, OffloadConfig
from moeflow.engine.memory import reserved_device_bytes
from moeflow.errors import SchedulingError
from moeflow.offload import create_expert_backend, min_slots

GiB = 2**30
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json, but torch_dtype float16 as AWQ conversions say (the release
    # says bfloat16; shapes checked in benchmarks/results/family_shapes.md)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-6,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
GPT_OSS_120B = {  # openai/gpt-oss-120b config.json (layer_types and quantization_config added when written)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
}
TINY = {
    "qwen3_moe": {**QWEN3_30B_A3B, "vocab_size": 97, "hidden_size": 64, "moe_intermediate_size": 64, "head_dim": 16,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
                  "num_hidden_layers": 2, "max_window_layers": 2, "max_position_embeddings": 512,
                  "bos_token_id": 1, "eos_token_id": 2},
    "gpt_oss": {**GPT_OSS_120B, "vocab_size": 97, "hidden_size": 64, "intermediate_size": 64, "head_dim": 16,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                "experts_per_token": 2, "num_hidden_layers": 2, "sliding_window": 4, "max_position_embeddings": 512,
                "eos_token_id": 2, "pad_token_id": 1},
}
TINY.update(family_writers.TINY)
FULL = {"qwen3_moe": QWEN3_30B_A3B, "gpt_oss": GPT_OSS_120B, **family_writers.FULL}
DEFAULT_LAYERS = {"qwen3_moe": None, "gpt_oss": 18, **family_writers.DEFAULT_LAYERS}
BUDGETS_GB = {"qwen3_moe": "4,8,12", "gpt_oss": "16,24", **family_writers.BUDGETS_GB}
# the checkpoints' dtypes: Qwen3's AWQ conversions are float16 (its release bf16), gpt-oss as published; the
# others': bfloat16
DTYPES = {"qwen3_moe": "float16", "gpt_oss": "bfloat16"}
POLICIES = ("lru", "mixtral-offloading", "static", "promoe", "duoserve")
MODES = ("never", "auto")
CONTEXT = 1024  # tokens the memory plan sizes the KV cache and prefill activations for
TEMPLATES = 4  # distinct random experts (Qwen3), reused round-robin: same speed, much faster writing


# ------------------------------------------------------------------------------------------ checkpoints
def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def _qwen3_layers(cfg: dict, group: int, gen: torch.Generator):
    """Yields each decoder layer's tensors {name: tensor} (experts AWQ, the rest fp16)."""
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]  # noqa: E741
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    templates = [{p: random_awq_linear(*shape, group, gen) for p, shape in
                  (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H)))} for _ in range(TEMPLATES)]
    attention = {"q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H), "o_proj": (H, nh * hd)}
    attention = {f"self_attn.{p}.weight": _normal(s, 0.02, gen, torch.float16) for p, s in attention.items()}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t = {f"{p}.{name}": w for name, w in attention.items()}
        for e in range(E):
            for proj, parts in templates[(layer * E + e) % TEMPLATES].items():
                for kind, tensor in parts.items():  # safetensors refuses shared memory within a file: clone
                    t[f"{p}.mlp.experts.{e}.{proj}.{kind}"] = tensor.clone()
        t[f"{p}.mlp.gate.weight"] = _normal((E, H), 0.02, gen, torch.float16)
        for norm, size in (("self_attn.q_norm", hd), ("self_attn.k_norm", hd), ("input_layernorm", H),
                           ("post_attention_layernorm", H)):
            t[f"{p}.{norm}.weight"] = torch.ones(size, dtype=torch.float16)
        yield t


def _gpt_oss_layers(cfg: dict, gen: torch.Generator):
    """Yields each decoder layer's tensors: MXFP4 experts as published (random e2m1 nibbles, e8m0 scales near
    2^-9 so activations stay finite), biases, attention, sinks, router and norms in bf16."""
    H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]  # noqa: E741
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    bf16 = torch.bfloat16
    experts = {}
    for part, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        experts[f"{part}_blocks"] = torch.randint(0, 256, (E, rows, k // 32, 16), generator=gen, dtype=torch.uint8)
        experts[f"{part}_scales"] = torch.randint(117, 121, (E, rows, k // 32), generator=gen, dtype=torch.uint8)
        experts[f"{part}_bias"] = _normal((E, rows), 0.02, gen, bf16)
    attention = {"q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H), "o_proj": (H, nh * hd)}
    fixed = {}
    for proj, (out, inp) in attention.items():
        fixed[f"self_attn.{proj}.weight"] = _normal((out, inp), 0.02, gen, bf16)
        fixed[f"self_attn.{proj}.bias"] = _normal((out,), 0.02, gen, bf16)
    fixed["self_attn.sinks"] = _normal((nh,), 1.0, gen, bf16)
    fixed["input_layernorm.weight"] = torch.ones(H, dtype=bf16)
    fixed["post_attention_layernorm.weight"] = torch.ones(H, dtype=bf16)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t = {f"{p}.{name}": w for name, w in fixed.items()}
        # one random expert set, rolled along the expert axis per layer (a copy: cheap next to random bytes)
        t.update({f"{p}.mlp.experts.{name}": w.roll(layer, 0) for name, w in experts.items()})
        t[f"{p}.mlp.router.weight"] = _normal((E, H), 0.02, gen, bf16)
        t[f"{p}.mlp.router.bias"] = _normal((E,), 0.02, gen, bf16)
        yield t


def write_family_checkpoint(directory: Path, family: str, cfg: dict, group_size: int = 128, seed: int = 0) -> Path:
    """A synthetic ``family`` checkpoint of config ``cfg`` in the published layout (one shard per layer + one for
    embeddings / final norm / lm_head); config.json is written last and marks it complete (then reused)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").is_file():
        return directory
    gen = torch.Generator().manual_seed(seed)
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    dtype = getattr(torch, DTYPES.get(family, "bfloat16"))
    if family in family_writers.FULL:  # their last shard comes from the family's own decoder too
        layers = family_writers.shards(cfg, group_size, dtype, seed)
    elif family == "gpt_oss":
        layers = _gpt_oss_layers(cfg, gen)
    else:
        layers = _qwen3_layers(cfg, group_size, gen)
    weight_map: dict[str, str] = {}
    total = 0
    last = [] if family in family_writers.FULL else [None]  # lazily: one layer's tensors in memory at a time
    for i, tensors in enumerate(itertools.chain(layers, last)):
        fname = f"model-{i + 1:05d}-of-{L + 1:05d}.safetensors"
        if tensors is None:  # the last shard (the new families' writer yields its own)
            tensors = {"model.embed_tokens.weight": _normal((V, H), 0.5, gen, dtype),
                       "lm_head.weight": _normal((V, H), 0.02, gen, dtype),
                       "model.norm.weight": torch.ones(H, dtype=dtype)}
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = dict(cfg)
    if family == "gpt_oss":
        config["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(L)]
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    elif family in family_writers.FULL:
        config["quantization_config"] = family_writers.quantization_config(group_size)
    else:  # AutoAWQ's GEMM format, experts only
        config["quantization_config"] = {"bits": 4, "group_size": group_size, "quant_method": "awq",
                                         "version": "gemm", "zero_point": True,
                                         "modules_to_not_convert": ["self_attn", "mlp.gate"]}
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def estimated_bytes(family: str, cfg: dict, group: int = 128) -> int:
    """Size of the checkpoint :func:`write_family_checkpoint` writes (to refuse early when the disk is short)."""
    if family in family_writers.FULL:
        return family_writers.estimated_bytes(cfg, group)
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    if family == "gpt_oss":
        I, E = cfg["intermediate_size"], cfg["num_local_experts"]  # noqa: E741
        expert = 3 * H * I * 17 // 32 + 3 * I * 2  # e2m1 nibbles + one scale byte per 32 + biases
        attn = 2 * H * cfg["head_dim"] * (cfg["num_attention_heads"] + cfg["num_key_value_heads"]) * 2
    else:
        I, E = cfg["moe_intermediate_size"], cfg["num_experts"]  # noqa: E741
        expert = 3 * H * I // 2 + 3 * H * I // group * 2 + 3 * H * I // group // 2  # qweight, scales, qzeros
        attn = 2 * H * cfg["head_dim"] * (cfg["num_attention_heads"] + cfg["num_key_value_heads"]) * 2
    return L * (E * expert + attn) + 2 * V * H * 2


# ------------------------------------------------------------------------------------------ configurations
def install(model: MoEModel, host, policy: str, budget: float, mode: str, tiny: bool, reserved: int,
            transport: str):
    """Swap in an expert backend for ``policy`` at ``budget`` (GB of device memory; slots with ``tiny``), sharing
    the filled host store; ``reserved``: the device bytes the memory plan gives everything but expert slots."""
    _free(model)
    fam = model.family
    size = {"gpu_expert_slots": int(budget)} if tiny else {"gpu_memory_gb": budget}
    config = OffloadConfig(policy=policy, transport=transport, context_length=CONTEXT, cpu_compute=mode, **size)
    blocks = model.model.moe_blocks
    backend = create_expert_backend(
        config, fmt=host.fmt, num_layers=len(fam.moe_layers), num_experts=fam.num_experts,
        top_k=fam.router_spec().top_k, device=model.device, kernels_backend=model.kernels,
        gates=[b.gate for b in blocks], route=blocks[0].route, reserved_bytes=reserved, stats=model.stats,
        host_store=host, checkpoint_dir=Path(model.name_or_path),
    )
    backend.finish_loading()
    model.use_backend(backend)
    _sync(model.device)
    return backend


def auto_over_never(runs: list[dict]) -> dict[str, float]:
    """Decode tok/s with cpu_compute "auto" over "never", per policy and budget (where both ran)."""
    tps = {(r["policy"], r["budget"], r["mode"]): r["tok_per_s"] for r in runs if r.get("tok_per_s")}
    return {f"{p} @ {b:g}": v / tps[(p, b, "never")] for (p, b, m), v in tps.items()
            if m == "auto" and (p, b, "never") in tps}


def write_report(out_dir: Path, result: dict) -> None:
    name = f"families_{result['family']}"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    env, ck = result["env"], result.get("checkpoint", {})
    lines = [f"# moeflow {result['family']} benchmark ({env.get('device_name', 'cpu')}, "
             f"{ck.get('layers')} of {ck.get('published_layers')} layers, {ck.get('bytes', 0) / GiB:.1f} GiB)", ""]
    if ck.get("layers", 0) < ck.get("published_layers", 0):
        lines += ["Fewer layers than published (same per-layer shapes): tok/s does not scale exactly with the "
                  "layer count; see ms/layer. A budget holds a larger share of these experts than of the full "
                  "model's.", ""]
    lines += ["| budget | slots | % experts | policy | cpu_compute | TTFT s | decode tok/s | ms/layer | decode hit | "
              "MiB moved | CPU experts | peak GiB | tokens = first |", "|" + "---|" * 13]
    for r in result["runs"]:
        head = f"| {r['budget']} | {r.get('slots', '-')} | {r.get('expert_share', 0):.0%} | {r['policy']} | " \
               f"{r['mode']} |"
        if "error" in r:
            lines.append(head + f" {r['error']} |" + " |" * 7)
            continue
        st = r["stats"]
        moved = (st["prefill"]["bytes_h2d"] + st["decode"]["bytes_h2d"]) / 2**20
        cpu_n = st["prefill"].get("cpu_experts", 0) + st["decode"].get("cpu_experts", 0)
        peak = (r["peak_gpu_bytes"] or 0) / GiB
        lines.append(head + f" {r['ttft_s']:.3f} | {r['tok_per_s'] or 0:.2f} | {r['ms_per_layer'] or 0:.2f} | "
                     f"{st['decode']['hit_rate']:.0%} | {moved:.1f} | {cpu_n} | {peak:.2f} | "
                     f"{r['tokens_equal_reference']} |")
    if result.get("auto_over_never"):
        lines += ["", "Decode tok/s, cpu_compute auto / never: " + ", ".join(
            f"{k}: {v:.2f}x" for k, v in result["auto_over_never"].items())]
    for policy, reason in result["skipped_policies"].items():
        lines += ["", f"{policy}: not run ({reason.split(';')[0]})"]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FULL), required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (budgets are slot counts)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="where the synthetic checkpoint is (or goes)")
    sliced = ", ".join(f"{k} {v}" for k, v in DEFAULT_LAYERS.items() if v)
    ap.add_argument("--layers", type=int, default=None, help=f"write fewer layers (defaults: {sliced})")
    ap.add_argument("--budgets", default=None, help=f"GB of device memory (defaults {BUDGETS_GB})")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--modes", default=",".join(MODES), help="cpu_compute values")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                    help="activations on the GPU (default: the published dtype, qwen3_moe AWQ fp16, others bf16)")
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="stop starting configurations after this")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_families"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    family = args.family

    if args.tiny:
        torch.set_num_threads(1)  # tiny tensors: intra-op threads only add wake-up latency
        device, dtype, kernels, group = torch.device("cpu"), torch.float32, "torch", 32
        cfg = dict(TINY[family])
        budgets = [float(b) for b in (args.budgets or "2,5").split(",")]
        prompt_len, new_tokens = args.prompt_len or 8, args.new_tokens or 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        device, kernels, group = torch.device("cuda"), "auto", 128
        dtype = getattr(torch, args.dtype or DTYPES.get(family, "bfloat16"))
        cfg = dict(FULL[family])
        budgets = [float(b) for b in (args.budgets or BUDGETS_GB[family]).split(",")]
        prompt_len, new_tokens = args.prompt_len or 64, args.new_tokens or 32
    published_layers = cfg["num_hidden_layers"]
    layers = args.layers or (None if args.tiny else DEFAULT_LAYERS[family])
    if layers:
        cfg = family_writers.slice_config(cfg, layers)
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    L = cfg["num_hidden_layers"]
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny-' if args.tiny else ''}{family}-L{L}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "argv": sys.argv[1:] if argv is None else argv, "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory)
    result: dict = {"family": family, "env": env, "config": cfg, "context_length": CONTEXT,
                    "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": [], "skipped_policies": {}}

    need = estimated_bytes(family, cfg, group)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ckpt.parent).free
    if not (ckpt / "config.json").is_file() and free < need * 1.05:
        raise SystemExit(f"{ckpt.parent}: {free / GiB:.1f} GiB free, the {family} checkpoint with {L} layers needs "
                         f"~{need / GiB:.1f} GiB (delete other synthetic checkpoints or pass --layers)")
    t0 = time.perf_counter()
    write_family_checkpoint(ckpt, family, cfg, group_size=group)
    on_disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    result["checkpoint"] = {"path": str(ckpt), "write_s": time.perf_counter() - t0, "bytes": on_disk,
                            "layers": L, "published_layers": published_layers}
    write_report(args.out, result)

    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(ckpt, device=device, dtype=dtype, kernels=kernels, progress=False,
                                     offload=OffloadConfig(policy="lru", gpu_expert_slots=min_slots(
                                         OffloadConfig(), cfg["num_experts_per_tok"]), context_length=CONTEXT,
                                         transport=args.transport))
    host = model.experts.host
    reserved = reserved_device_bytes(model.memory_plan())
    total_experts = len(model.family.moe_layers) * model.family.num_experts
    result["checkpoint"].update(load_s=time.perf_counter() - t0, expert_bytes=host.fmt.nbytes,
                                reserved_device_bytes=reserved, memory_plan=model.memory_plan().as_dict())
    prompt = torch.randint(3, cfg["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt[:, :4], max_new_tokens=2, do_sample=False)  # warm-up (compilation), not measured
    write_report(args.out, result)

    expected = None
    # every "never" configuration first: the first "auto" one builds the CPU forms of all experts (minutes at
    # these sizes), and a stage cut short must still have the GPU-only numbers
    for mode in args.modes.split(","):
        for budget in budgets:
            for policy in args.policies.split(","):
                if policy in result["skipped_policies"]:
                    continue
                run = {"budget": budget, "policy": policy, "mode": mode}
                if time.perf_counter() - t_start > args.time_budget_s:
                    result["runs"].append({**run, "error": "skipped: time budget"})
                    continue
                try:
                    backend = install(model, host, policy, budget, mode, args.tiny, reserved, args.transport)
                    row, out = run_config(model, prompt, new_tokens, expected, eos_token_id=[])
                except SchedulingError as exc:  # a predictor file missing, a budget too small: the reason
                    reason = str(exc).splitlines()[0]
                    if "predictor" in reason:  # the policy cannot run here at all: say so once
                        result["skipped_policies"][policy] = reason
                        continue
                    result["runs"].append({**run, "error": f"skipped: {reason}"})
                    write_report(args.out, result)
                    continue
                except Exception as exc:  # one failing configuration must not lose the others
                    result["runs"].append({**run, "error": f"{type(exc).__name__}: {exc}"})
                    write_report(args.out, result)
                    continue
                expected = out if expected is None else expected
                slots = backend.n_slots
                tpot = row["tpot_s"]
                row.update(slots=slots, expert_share=slots / total_experts,
                           ms_per_layer=tpot * 1e3 / L if tpot else None)
                result["runs"].append({**run, **row})
                result["auto_over_never"] = auto_over_never(result["runs"])
                write_report(args.out, result)
                print(f"{budget:>5} {policy:>20} {mode:>6}: {row['summary']}", flush=True)
    result["total_s"] = time.perf_counter() - t_start
    write_report(args.out, result)
    model.close()
    print((args.out / f"families_{family}.md").read_text())
    return result


if __name__ == "__main__":
    main()
