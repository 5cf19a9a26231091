"""The synthetic Mixtral-8x7B-shaped AWQ checkpoint the GPU lane's offload, engine and models stages share.

``write_synthetic_awq_checkpoint`` writes the exact tensor shapes of Mixtral-8x7B in AWQ 4-bit, group 128 (random
weights, ~24.6 GB; ``--layers`` writes fewer layers of the same shapes), or the tiny CPU model with ``--tiny``; a
checkpoint already there (its config.json written last) is reused. ``mixtral_setup`` picks device, dtype, kernels
and the checkpoint path from ``add_checkpoint_args``' arguments.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
    rms_norm_eps=1e-5, rope_theta=1e6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=1e6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
TEMPLATES = 4  # distinct random experts, reused round-robin: the speed is the same, the writing much faster


# ------------------------------------------------------------------------------------------ checkpoint
def random_awq_linear(fan_in: int, fan_out: int, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random AWQ GEMM tensors whose dequantized weights are small ((q - z) * ~2e-3), so fp16 stays finite."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (fan_in, fan_out // 8), generator=gen, dtype=torch.int64)
    qzeros = torch.full((fan_in // group, fan_out // 8), 0x88888888 - 2**32, dtype=torch.int64)  # zero point 8
    scales = torch.rand((fan_in // group, fan_out), generator=gen) * 2e-3 + 1e-3
    return {"qweight": qweight.to(torch.int32), "qzeros": qzeros.to(torch.int32), "scales": scales.half()}


def write_synthetic_awq_checkpoint(directory: Path, config: dict, group_size: int = 128, seed: int = 0) -> Path:
    """Mixtral-shaped AWQ checkpoint (experts and attention quantized; router, norms, embeddings fp16)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").is_file():
        return directory  # written by an earlier run
    gen = torch.Generator().manual_seed(seed)
    H, I = config["hidden_size"], config["intermediate_size"]  # noqa: E741
    L, E = config["num_hidden_layers"], config["num_local_experts"]
    head_dim = H // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    templates = [
        {w: random_awq_linear(*shape, group_size, gen) for w, shape in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H)))}
        for _ in range(TEMPLATES)
    ]
    attention = {p: random_awq_linear(H, out, group_size, gen) for p, out in (("q", H), ("k", kv), ("v", kv), ("o", H))}
    weight_map: dict[str, str] = {}
    total = 0

    def save(tensors: dict[str, torch.Tensor], fname: str) -> None:
        nonlocal total
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()

    shards = L + 1
    for layer in range(L):
        t: dict[str, torch.Tensor] = {}
        p = f"model.layers.{layer}"
        for e in range(E):
            tpl = templates[(layer * E + e) % TEMPLATES]
            for w, parts in tpl.items():
                for kind, tensor in parts.items():
                    # safetensors refuses tensors sharing memory within a file: one copy per expert
                    t[f"{p}.block_sparse_moe.experts.{e}.{w}.{kind}"] = tensor.clone()
        for proj, parts in attention.items():
            for kind, tensor in parts.items():
                t[f"{p}.self_attn.{proj}_proj.{kind}"] = tensor
        t[f"{p}.block_sparse_moe.gate.weight"] = (torch.randn((E, H), generator=gen) * 0.02).half()
        t[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.float16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.float16)
        save(t, f"model-{layer + 1:05d}-of-{shards:05d}.safetensors")
    V = config["vocab_size"]
    save(
        {
            "model.embed_tokens.weight": (torch.randn((V, H), generator=gen) * 0.5).half(),
            "lm_head.weight": (torch.randn((V, H), generator=gen) * 0.02).half(),
            "model.norm.weight": torch.ones(H, dtype=torch.float16),
        },
        f"model-{shards:05d}-of-{shards:05d}.safetensors",
    )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg = {
        **config, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "torch_dtype": "float16",
        "quantization_config": {
            "bits": 4, "group_size": group_size, "modules_to_not_convert": ["gate"], "quant_method": "awq",
            "version": "gemm", "zero_point": True,
        },
    }
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))  # last: marks the checkpoint complete
    return directory


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """--tiny / --checkpoint / --layers: the synthetic Mixtral checkpoint the offload and engine stages share."""
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on the CPU (exercises the code)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="where the synthetic checkpoint is (or goes)")
    ap.add_argument("--layers", type=int, default=None, help="write fewer layers (same shapes per layer)")


def mixtral_setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, dict, str, int, Path]:
    """(device, dtype, config, kernels, group size, checkpoint dir): the CPU and a tiny model with --tiny, else
    CUDA and Mixtral-8x7B's shapes (--layers of them)."""
    if args.tiny:
        torch.set_num_threads(1)  # tiny tensors: intra-op threads only add wake-up latency to every copy
        device, dtype, config, kernels, group = torch.device("cpu"), torch.float32, dict(TINY), "torch", 32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        device, dtype, config, kernels, group = torch.device("cuda"), torch.float16, dict(MIXTRAL_8X7B), "auto", 128
    if args.layers:
        config["num_hidden_layers"] = args.layers
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny' if args.tiny else 'mixtral-8x7b'}-awq-L{config['num_hidden_layers']}")
    return device, dtype, config, kernels, group, ckpt
