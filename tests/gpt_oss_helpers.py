"""Tiny random gpt-oss checkpoints written by transformers' GptOssForCausalLM (bf16/fp32 or MXFP4 experts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4

GPT_OSS_DEFAULTS = dict(
    vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    max_position_embeddings=256,
)


def make_gpt_oss_model(seed: int = 0, **overrides):
    """A random transformers GptOssForCausalLM (fp32, eval). Weights scaled up (0.1, router 0.5, sinks 1.0) so
    routing, the sinks and the clamp of the SwiGLU all matter."""
    import transformers
    from transformers import GptOssConfig, GptOssForCausalLM

    transformers.logging.set_verbosity_error()  # tiny configs trip YaRN's factor-ratio warning
    torch.manual_seed(seed)
    cfg = GptOssConfig(**{**GPT_OSS_DEFAULTS, **overrides})
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, 0.5 if "router" in name else 1.0 if "sinks" in name else 0.1)
            if "experts" in name and "bias" not in name:
                p.mul_(4.0)  # large enough that |gate|, |up| pass the clamp limit sometimes
    return model


def quantize_experts_mxfp4(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Round every expert weight of ``model`` to MXFP4 in place; return the published tensors
    {"model.layers.L.mlp.experts.{gate_up_proj,down_proj}": (blocks, scales)}."""
    published = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for part in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, part)  # [E, in, out] (y = x @ W)
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))  # published: [E, out, in/32, 16]
                p.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                published[f"model.layers.{i}.mlp.experts.{part}"] = (blocks, scales)
    return published


def save_gpt_oss_checkpoint(model, directory: str | Path, mxfp4: bool = False, dtype: torch.dtype = torch.float32
                            ) -> Path:
    """save_pretrained; with ``mxfp4`` the experts are first rounded to MXFP4 (the model keeps the dequantized
    values, the reference) and written in the published layout with ``quant_method: mxfp4``."""
    directory = Path(directory)
    published = quantize_experts_mxfp4(model) if mxfp4 else {}
    model.to(dtype).save_pretrained(directory)
    if mxfp4:
        path = directory / "model.safetensors"
        tensors = load_file(path)
        for name, (blocks, scales) in published.items():
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        save_file(tensors, path, metadata={"format": "pt"})
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def gpt_oss_checkpoint_pair(root: Path, seed: int, **overrides) -> dict[str, Path]:
    """The same tiny gpt-oss (``make_gpt_oss_model(seed, **overrides)``) as a safetensors MXFP4 checkpoint
    (``"mxfp4"``) and as a GGUF file (``"gguf"``: MXFP4 experts, Q8_0 attention and output.weight) under ``root``.
    Needs the ``gguf`` package."""
    from gguf_gpt_oss import write_gpt_oss_gguf

    write_gpt_oss_gguf(make_gpt_oss_model(seed=seed, **overrides), root / "m.gguf")
    return {"mxfp4": save_gpt_oss_checkpoint(make_gpt_oss_model(seed=seed, **overrides), root / "st", mxfp4=True),
            "gguf": root / "m.gguf"}
