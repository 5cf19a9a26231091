"""Reading SwiGLU experts from a checkpoint, whatever a family calls their projections.

Layouts (detected from the names; ``base`` is e.g. ``model.layers.3.mlp.experts``):

* per expert: ``{base}.{e}.{gate,up,down}.weight`` (dense) or ``.qweight/.qzeros/.scales`` (AWQ GEMM, or
  GPTQ or compressed-tensors W4A16 already repacked into AWQ's layout by the reader);
* fused (transformers 5.x in memory): ``{base}.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
  ``{base}.down_proj`` ``[E, H, I]``.

Every reader returns the tensors of one expert in the names of the kernels' ``ExpertFormat``
(``w13``/``w2`` dense, ``w13_qweight``... for AWQ), gate before up as the kernels compute ``silu(gate) * up``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moeflow.errors import CheckpointError
from moeflow.families.base import ExpertLayout
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec, get_slice
from moeflow.io.expert_index import joined_empty

AWQ_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class ProjectionNames:
    """The checkpoint names of an expert's three projections (Mixtral: w1/w3/w2; Qwen, OLMoE: *_proj)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"



def concat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` for the expert read paths: one buffer and a copy per part. The expert index plans reads on
    meta tensors, and ``torch.cat``'s meta kernel is a Python decomposition whose first call imports
    ``torch._dynamo`` (~1.8 s of a cold start, docs/disk.md); the copies' meta kernels are not. Inside an
    :class:`~moeflow.io.expert_index.ExpertIndex` read the buffer is the read's arena
    (:func:`~moeflow.io.expert_index.joined_empty`), not a fresh allocation per expert."""
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = joined_empty(tensors[0], shape)
    start = 0
    for t in tensors:
        out.narrow(dim, start, t.shape[dim]).copy_(t)
        start += t.shape[dim]
    return out

def detect_gated_layout(reader: CheckpointReader, layer_prefix: str, moe_prefix: str, names: ProjectionNames,
                        num_experts: int, experts_key: str) -> ExpertLayout:
    """The layout of the experts under ``{layer_prefix}.{moe_prefix}.experts`` (one MoE layer), checking that
    the checkpoint holds as many experts as config.json's ``experts_key`` says (the error names both)."""
    base = f"{layer_prefix}.{moe_prefix}.experts"
    if f"{base}.gate_up_proj" in reader:
        found = reader.shape(f"{base}.gate_up_proj")[0]
        _check_count(found, num_experts, experts_key, f"{base}.gate_up_proj", reader)
        return ExpertLayout(moe_prefix, fused=True, awq=False)
    for suffix, awq in (("qweight", True), ("weight", False)):
        if f"{base}.0.{names.gate}.{suffix}" in reader:
            pattern = re.compile(rf"^{re.escape(base)}\.(\d+)\.{re.escape(names.gate)}\.{suffix}$")
            found = 1 + max(int(m.group(1)) for n in reader.names() if (m := pattern.match(n)))
            _check_count(found, num_experts, experts_key, f"{base}.*.{names.gate}.{suffix}", reader)
            scales = reader.get(f"{base}.0.{names.gate}.scales").dtype if awq else None
            return ExpertLayout(moe_prefix, fused=False, awq=awq, scales_dtype=scales)
    raise CheckpointError(
        f"no expert tensors for the first MoE layer in {reader.directory}: expected "
        f"'{base}.0.{names.gate}.weight' (or .qweight when quantized) or '{base}.gate_up_proj'"
    )


def _check_count(found: int, expected: int, key: str, where: str, reader: CheckpointReader) -> None:
    if found != expected:
        raise CheckpointError(f"the checkpoint in {reader.directory} holds {found} experts ({where}) but "
                              f"config.json says {key}={expected}")


def read_gated_expert(reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                      base: str, expert: int, names: ProjectionNames, hidden: int, intermediate: int,
                      num_experts: int) -> dict[str, torch.Tensor]:
    """One expert of ``base`` (``model.layers.L.mlp.experts``) on the CPU, in the kernels' names:
    dense ``w13`` [2I, H], ``w2`` [H, I]; AWQ ``w13_*`` (gate then up, concatenated along N) and ``w2_*``."""
    H, I = hidden, intermediate  # noqa: E741
    if layout.fused:
        return {"w13": get_slice(reader, f"{base}.gate_up_proj", expert, (num_experts, 2 * I, H)),
                "w2": get_slice(reader, f"{base}.down_proj", expert, (num_experts, H, I))}
    name = f"{base}.{expert}"
    if not layout.awq:
        gate = reader.get(f"{name}.{names.gate}.weight", (I, H))
        up = reader.get(f"{name}.{names.up}.weight", (I, H))
        return {"w13": concat([gate, up], dim=0), "w2": reader.get(f"{name}.{names.down}.weight", (H, I))}
    if quant is None:
        raise CheckpointError(f"expert tensors under {base} are quantized (qweight) but the checkpoint has no "
                              "quantization_config in config.json")
    g = quant.group_size
    shapes = {"qweight": lambda k, n: (k, n // 8), "qzeros": lambda k, n: (k // g, n // 8),
              "scales": lambda k, n: (k // g, n)}
    out: dict[str, torch.Tensor] = {}
    for part in AWQ_PARTS:
        gate = reader.get(f"{name}.{names.gate}.{part}", shapes[part](H, I))
        up = reader.get(f"{name}.{names.up}.{part}", shapes[part](H, I))
        out[f"w13_{part}"] = concat([gate, up], dim=1)
        out[f"w2_{part}"] = reader.get(f"{name}.{names.down}.{part}", shapes[part](I, H))
    return out


def expert_linear_weights(name: str, reader: CheckpointReader, moe_prefix: str, names: ProjectionNames,
                          out_names: ProjectionNames | None = None, out_prefix: str | None = None,
                          ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """For ``moeflow quantize``: the per-expert ``[out, in]`` weights held by tensor ``name`` with the module
    names an AWQ checkpoint stores them under (``out_names``/``out_prefix``: rename them), or None when
    ``name`` holds no expert weight."""
    out_names, out_prefix = out_names or names, out_prefix or moe_prefix
    rename = {names.gate: out_names.gate, names.up: out_names.up, names.down: out_names.down}
    per_expert = re.match(rf"^(model\.layers\.\d+)\.{re.escape(moe_prefix)}\.experts\.(\d+)\."
                          rf"({'|'.join(map(re.escape, rename))})\.weight$", name)
    if per_expert:
        layer, expert, proj = per_expert.groups()
        return iter([(f"{layer}.{out_prefix}.experts.{expert}.{rename[proj]}", reader.get(name))])
    fused = re.match(rf"^(model\.layers\.\d+)\.(?:{re.escape(moe_prefix)}|mlp)\.experts\.(gate_up_proj|down_proj)$",
                     name)
    if fused:
        return split_fused_experts(reader.get(name), fused.group(1), fused.group(2), out_prefix, out_names)
    return None


def split_fused_experts(stacked: torch.Tensor, layer: str, kind: str, prefix: str, names: ProjectionNames
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """stacked [E, 2I, H] (``gate_up_proj``) or [E, H, I] (``down_proj``) -> per-expert ``[out, in]`` weights named
    ``{layer}.{prefix}.experts.{e}.{projection}``."""
    for e in range(stacked.shape[0]):
        base = f"{layer}.{prefix}.experts.{e}"
        if kind == "gate_up_proj":
            gate, up = stacked[e].chunk(2, dim=0)
            yield f"{base}.{names.gate}", gate
            yield f"{base}.{names.up}", up
        else:
            yield f"{base}.{names.down}", stacked[e]
