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

    from moeflow.kernels.cpu.int4 import int4_cpu_available
    from moeflow.tools.quantize import quantize_checkpoint

    if not int4_cpu_available():
        pytest.skip("this torch build has no int4 CPU kernels")
    root = Path(root)
    src = make_tiny_checkpoint(root / "fp32", seed=seed, hidden_size=128, intermediate_size=128, **overrides)
    return quantize_checkpoint(src, root / "awq", group_size=32, progress=False)


def host_budget_rows_gb(path: str | Path, rows: int, readers: int, dtype: torch.dtype = torch.float32) -> float:
    """``OffloadConfig.host_memory_gb`` that holds exactly ``rows`` experts of the checkpoint at ``path`` (any
    family, any quantized format) next to its non-expert weights, a 4096-token KV cache and ``readers`` disk
    staging buffers: the disk tier serves the rest."""
    from moeflow import MoEModel
    from moeflow.engine.build import open_expert_index
    from moeflow.engine.loading import non_expert_bytes
    from moeflow.engine.memory import kv_cache_bytes
    from moeflow.families import family_for_config
    from moeflow.io.checkpoint import open_checkpoint, read_json, read_quantization
    from moeflow.offload.cpu_slots import CpuInt4Format

    path = Path(path)
    raw = read_json(path / "config.json")
    family, quant = family_for_config(raw, "config.json"), read_quantization(path, raw)
    reader = open_checkpoint(path, quant)
    try:
        index = open_expert_index(reader, family, family.detect_expert_layout(reader), quant)
        index.close()
    finally:
        reader.close()
    resident = MoEModel.from_pretrained(path)
    row = resident.experts.fmt.nbytes
    if resident.kernels == "cpu-int4":  # offloading on the CPU stores torch's int4 form (moeflow.offload.cpu_slots)
        row = CpuInt4Format.of(resident.experts.fmt).nbytes
    reserved = non_expert_bytes(resident.model) + kv_cache_bytes(family.config, dtype, 4096)
    return (reserved + readers * index.staging_nbytes + rows * row + row // 2) / 2**30


def count_calls(monkeypatch, owner: object, name: str) -> list[int]:
    """Wrap ``owner.name`` (a module's function: e.g. ``cpu_layers.layers_step``, the one native step call) so that
    each call adds one to the returned counter ``[n]``, for the rest of the test (monkeypatch undoes it)."""
    calls, inner = [0], getattr(owner, name)

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(owner, name, counted)
    return calls
