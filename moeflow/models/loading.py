"""Turning a checkpoint into a model: non-expert weights into modules, experts into the expert backend.

Expert tensor layouts understood (detected from the names):
* classic: ``model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.weight`` (or ``.qweight/.qzeros/.scales``
  for AWQ), router ``model.layers.L.block_sparse_moe.gate.weight``;
* fused (recent transformers in memory): ``model.layers.L.{mlp,block_sparse_moe}.experts.gate_up_proj``
  ``[E, 2I, H]`` (w1 rows first) and ``...experts.down_proj`` ``[E, H, I]``, router ``...gate.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from moeflow.errors import CheckpointError
from moeflow.kernels.pool import ExpertFormat
from moeflow.models.checkpoint import CheckpointReader, QuantizationSpec, get_slice
from moeflow.models.layers import AWQLinear
from moeflow.models.mixtral import MixtralConfig, MixtralModel

MOE_PREFIXES = ("block_sparse_moe", "mlp")


@dataclass(frozen=True)
class ExpertSource:
    """Where and how a checkpoint stores its experts."""

    prefix: str  # "block_sparse_moe" or "mlp"
    fused: bool
    awq: bool
    scales_dtype: torch.dtype | None = None


def detect_expert_source(reader: CheckpointReader, cfg: MixtralConfig) -> ExpertSource:
    for prefix in MOE_PREFIXES:
        base = f"model.layers.0.{prefix}.experts"
        if f"{base}.gate_up_proj" in reader:
            return ExpertSource(prefix, fused=True, awq=False)
        if f"{base}.0.w1.qweight" in reader:
            scales = reader.get(f"{base}.0.w1.scales")
            return ExpertSource(prefix, fused=False, awq=True, scales_dtype=scales.dtype)
        if f"{base}.0.w1.weight" in reader:
            return ExpertSource(prefix, fused=False, awq=False)
    raise CheckpointError(
        f"no expert tensors for layer 0 in {reader.directory}: expected "
        "'model.layers.0.block_sparse_moe.experts.0.w1.weight' (or .qweight for AWQ) or "
        "'model.layers.0.mlp.experts.gate_up_proj'"
    )


def expert_format(cfg: MixtralConfig, source: ExpertSource, quant: QuantizationSpec | None,
                  dtype: torch.dtype) -> ExpertFormat:
    if source.awq:
        if quant is None:
            raise CheckpointError("expert tensors are AWQ-quantized (qweight) but the checkpoint has no "
                                  "quantization_config in config.json nor a quant_config.json")
        return ExpertFormat(cfg.hidden_size, cfg.intermediate_size, "awq", source.scales_dtype, quant.group_size)
    return ExpertFormat(cfg.hidden_size, cfg.intermediate_size, "dense", dtype)


def read_expert(
    reader: CheckpointReader, cfg: MixtralConfig, source: ExpertSource, quant: QuantizationSpec | None,
    layer: int, expert: int,
) -> dict[str, torch.Tensor]:
    """One expert's tensors, named and shaped as its :class:`ExpertFormat` wants (CPU)."""
    H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts  # noqa: E741
    base = f"model.layers.{layer}.{source.prefix}.experts"
    if source.fused:
        return {
            "w13": get_slice(reader, f"{base}.gate_up_proj", expert, (E, 2 * I, H)),
            "w2": get_slice(reader, f"{base}.down_proj", expert, (E, H, I)),
        }
    name = f"{base}.{expert}"
    if not source.awq:
        w1 = reader.get(f"{name}.w1.weight", (I, H))
        w3 = reader.get(f"{name}.w3.weight", (I, H))
        return {"w13": torch.cat([w1, w3], dim=0), "w2": reader.get(f"{name}.w2.weight", (H, I))}
    g = quant.group_size
    out: dict[str, torch.Tensor] = {}
    for part, (fan_in, fan_out) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
        for kind, shape in (("qweight", (fan_in, fan_out // 8)), ("qzeros", (fan_in // g, fan_out // 8)),
                            ("scales", (fan_in // g, fan_out))):
            out[f"{part}.{kind}"] = reader.get(f"{name}.{part}.{kind}", shape)
    fused = {f"w13_{kind}": torch.cat([out[f"w1.{kind}"], out[f"w3.{kind}"]], dim=1)
             for kind in ("qweight", "qzeros", "scales")}
    fused.update({f"w2_{kind}": out[f"w2.{kind}"] for kind in ("qweight", "qzeros", "scales")})
    return fused


def load_non_expert_weights(
    model: MixtralModel, reader: CheckpointReader, cfg: MixtralConfig, source: ExpertSource,
    device: torch.device, dtype: torch.dtype,
) -> None:
    """Fill every parameter/buffer of ``model`` from the checkpoint, checking shapes against config.json."""
    prefix_moe = source.prefix
    for module_name, module in model.named_modules():
        for pname, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if module_name == "rotary":
                continue
            full = f"{module_name}.{pname}"
            ckpt = _checkpoint_name(full, prefix_moe)
            if full == "lm_head.weight" and ckpt not in reader and cfg.tie_word_embeddings:
                ckpt = "model.embed_tokens.weight"
            src = reader.get(ckpt, tuple(tensor.shape))
            target_dtype = tensor.dtype if isinstance(module, AWQLinear) else dtype
            with torch.no_grad():
                tensor.data = src.to(device=device, dtype=target_dtype)


def _checkpoint_name(module_path: str, moe_prefix: str) -> str:
    if module_path.startswith("lm_head."):
        return module_path
    name = "model." + module_path
    return name.replace(".block_sparse_moe.", f".{moe_prefix}.")


def detect_awq_attention(reader: CheckpointReader, quant: QuantizationSpec | None) -> dict | None:
    if "model.layers.0.self_attn.q_proj.qweight" not in reader:
        return None
    if quant is None:
        raise CheckpointError("attention tensors are AWQ-quantized (qweight) but the checkpoint has no "
                              "quantization_config")
    scales = reader.get("model.layers.0.self_attn.q_proj.scales")
    return {"group_size": quant.group_size, "scales_dtype": scales.dtype}


def iter_experts(
    reader: CheckpointReader, cfg: MixtralConfig, source: ExpertSource, quant: QuantizationSpec | None,
    progress: bool,
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield (layer, expert, tensors) one expert at a time, with a progress bar on large checkpoints."""
    total = cfg.num_hidden_layers * cfg.num_local_experts
    bar = tqdm(total=total, desc="loading experts", unit="expert", disable=not progress)
    try:
        for layer in range(cfg.num_hidden_layers):
            for expert in range(cfg.num_local_experts):
                yield layer, expert, read_expert(reader, cfg, source, quant, layer, expert)
                bar.update(1)
    finally:
        bar.close()


def non_expert_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def read_routers(directory) -> tuple[list[torch.Tensor], int]:
    """(router weight fp32 [E, H] of every MoE layer, top-k) of an HF-layout Mixtral checkpoint directory, reading
    no expert weight (skip-gate predictors, the simulator's ``--gates``)."""
    from pathlib import Path

    from moeflow.models.checkpoint import read_json

    directory = Path(directory)
    cfg = MixtralConfig.from_dict(read_json(directory / "config.json"), str(directory / "config.json"))
    reader = CheckpointReader(directory)
    try:
        weights = []
        for layer in range(cfg.num_hidden_layers):
            names = [f"model.layers.{layer}.{prefix}.gate.weight" for prefix in MOE_PREFIXES]
            name = next((n for n in names if n in reader), names[0])
            weights.append(reader.get(name, (cfg.num_local_experts, cfg.hidden_size)).float())
    finally:
        reader.close()
    return weights, cfg.num_experts_per_tok

