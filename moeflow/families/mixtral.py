"""Mixtral: the family moeflow started with (Mixtral-8x7B / 8x22B and their HF-layout checkpoints).

Every decoder layer is attention + a sparse MoE block of ``num_local_experts`` SwiGLU experts with
softmax-top-k routing. Expert tensor layouts understood (detected from the names):

* classic: ``model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.weight`` (or ``.qweight/.qzeros/.scales``
  for AWQ), router ``model.layers.L.block_sparse_moe.gate.weight``;
* fused (recent transformers in memory): ``model.layers.L.{mlp,block_sparse_moe}.experts.gate_up_proj``
  ``[E, 2I, H]`` (w1 rows first) and ``...experts.down_proj`` ``[E, H, I]``, router ``...gate.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout, ExpertSpec, Family
from moeflow.families.gated_experts import ProjectionNames, read_gated_expert, split_fused_experts
from moeflow.families.layers import Attention, LinearFactory, PreNormLayer, RMSNorm
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

MOE_PREFIXES = ("block_sparse_moe", "mlp")
PROJECTIONS = ProjectionNames(gate="w1", up="w3", down="w2")
CLASSIC_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")


@dataclass
class MixtralConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int = 32768
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise CheckpointError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} must lie in "
                f"[1, num_local_experts={self.num_local_experts}]"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> MixtralConfig:
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only the default rotary)")
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        names = {f.name for f in fields(cls)}
        required = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_local_experts", "num_experts_per_tok") if n not in d]
        if required:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(required)}")
        if d.get("rope_theta") is None:
            d.pop("rope_theta", None)
        return cls(**{k: v for k, v in d.items() if k in names})


class DecoderLayer(PreNormLayer):
    """Attention + sparse MoE block (``block_sparse_moe``), pre-norm residual. ``attention_options``: keyword
    options of :class:`~moeflow.families.layers.Attention` (MiniMax-M2's QK-norm and partial rotary)."""

    def __init__(self, cfg: MixtralConfig, layer_idx: int, dtype: torch.dtype, linear_factory: LinearFactory,
                 router: RouterSpec, **attention_options: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   layer_idx, linear_factory, cfg.sliding_window, dtype=dtype, **attention_options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # every Mixtral layer is an MoE layer: its MoE index is its layer index
        self.block_sparse_moe = MoEBlock(cfg.hidden_size, cfg.num_local_experts, router, layer_idx, dtype)

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None):
        x, h = self.attention_half(x, cos, sin, cache, cache_position, mask)
        return x + self.block_sparse_moe(h, experts, routing)


class MixtralFamily(Family):
    name = "mixtral"
    model_types = ("mixtral",)
    config: MixtralConfig

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MixtralConfig:
        return MixtralConfig.from_dict(raw, source)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.config.num_hidden_layers))

    @property
    def num_experts(self) -> int:
        return self.config.num_local_experts

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="softmax", renormalize=True)

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(self.config.hidden_size, self.config.intermediate_size, activation="silu")

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg, router = self.config, self.router_spec()
        layers = [DecoderLayer(cfg, i, dtype, linear_factory, router) for i in range(cfg.num_hidden_layers)]
        return CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.head_dim,
                             cfg.rope_theta, dtype, cfg.sliding_window)

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        if param_path.startswith("lm_head."):
            return param_path
        return ("model." + param_path).replace(".block_sparse_moe.", f".{layout.prefix}.")

    def detect_expert_layout(self, reader: CheckpointReader) -> ExpertLayout:
        for prefix in MOE_PREFIXES:
            base = f"model.layers.0.{prefix}.experts"
            if f"{base}.gate_up_proj" in reader:
                return ExpertLayout(prefix, fused=True, awq=False)
            if f"{base}.0.w1.qweight" in reader:
                scales = reader.get(f"{base}.0.w1.scales")
                return ExpertLayout(prefix, fused=False, awq=True, scales_dtype=scales.dtype)
            if f"{base}.0.w1.weight" in reader:
                return ExpertLayout(prefix, fused=False, awq=False)
        raise CheckpointError(
            f"no expert tensors for layer 0 in {reader.directory}: expected "
            "'model.layers.0.block_sparse_moe.experts.0.w1.weight' (or .qweight for AWQ) or "
            "'model.layers.0.mlp.experts.gate_up_proj'"
        )

    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        return read_gated_expert(reader, layout, quant, f"model.layers.{moe_layer}.{layout.prefix}.experts", expert,
                                 PROJECTIONS, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts)

    # ------------------------------------------------------------------ quantization (moeflow quantize)
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        m = CLASSIC_EXPERT.match(name)
        if m:
            layer, _, expert, w = m.groups()
            return iter([(f"{layer}.block_sparse_moe.experts.{expert}.{w}", reader.get(name))])
        m = FUSED_EXPERT.match(name)
        if m:
            layer, kind = m.group(1, 3)
            return split_fused_experts(reader.get(name), layer, kind, "block_sparse_moe", PROJECTIONS)
        return None

    def quantized_name(self, name: str) -> str:
        return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
