"""Shared test utilities: tiny random Mixtral checkpoints written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_DEFAULTS = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def make_tiny_config(**overrides):
    from transformers import MixtralConfig

    kwargs = {**TINY_DEFAULTS, **overrides}
    cfg = MixtralConfig(**kwargs)
    return cfg


def make_tiny_model(seed: int = 0, **overrides):
    """A random transformers MixtralForCausalLM (fp32, eval mode). Weights are scaled up a little so
    routing and logits are far from uniform (random init at std 0.02 gives near-tied logits)."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(make_tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1 if "gate" not in name or "gate_up" in name else 0.5)
    return model


def make_tiny_checkpoint(directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **overrides) -> Path:
    """Save a tiny random Mixtral checkpoint (safetensors, classic per-expert names) into ``directory``."""
    directory = Path(directory)
    model = make_tiny_model(seed, **overrides).to(dtype)
    model.save_pretrained(directory)
    return directory


def make_tiny_awq_checkpoint(root: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny Mixtral (hidden and intermediate 128) quantized to AWQ experts (group 32) under ``root``: what the
    CPU int4 paths (resident ``CpuInt4Experts``, int4 slots, hybrid execution) run. Skips the test when this
    torch build has no int4 CPU kernels."""
    import pytest

    from moeflow.kernels.cpu_int4 import int4_cpu_available
    from moeflow.quant.convert import quantize_checkpoint

    if not int4_cpu_available():
        pytest.skip("this torch build has no int4 CPU kernels")
    root = Path(root)
    src = make_tiny_checkpoint(root / "fp32", seed=seed, hidden_size=128, intermediate_size=128, **overrides)
    return quantize_checkpoint(src, root / "awq", group_size=32, progress=False)
