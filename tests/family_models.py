"""Tiny random Qwen3-MoE / Qwen2-MoE / OLMoE checkpoints written by transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FAMILY_DEFAULTS = {
    "qwen3_moe": dict(moe_intermediate_size=32, intermediate_size=48),
    "qwen2_moe": dict(moe_intermediate_size=32, intermediate_size=48, shared_expert_intermediate_size=40),
    "olmoe": dict(intermediate_size=32, pad_token_id=1, eos_token_id=2),
}


def classes(model_type: str):
    import transformers as tf

    return {"qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
            "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
            "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM)}[model_type]


def make_family_model(model_type: str, seed: int = 0, **overrides):
    """A random transformers model (fp32, eval). Weights are scaled so routing and logits are far from uniform;
    norm weights are randomised around 1 so a norm loaded wrongly (or not at all) shows."""
    config_cls, model_cls = classes(model_type)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **FAMILY_DEFAULTS[model_type], **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def make_family_checkpoint(directory: str | Path, model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                           max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random checkpoint (safetensors, per-expert names, as transformers writes them)."""
    directory = Path(directory)
    model = make_family_model(model_type, seed, **overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
