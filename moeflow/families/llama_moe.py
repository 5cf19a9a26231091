"""The decoder Qwen2-MoE, Qwen3-MoE and OLMoE share: Llama-style layers whose MLP is an MoE block or a dense one.

Each layer: ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))`` where ``mlp`` is
an :class:`~moeflow.moe.block.MoEBlock` (softmax top-k router ``mlp.gate``, routed experts
``mlp.experts.*`` served by the expert backend, optionally a resident shared expert ``mlp.shared_expert``
scaled by ``sigmoid(mlp.shared_expert_gate(x))``) or, in the layers ``decoder_sparse_step`` /
``mlp_only_layers`` leave dense, a resident :class:`~moeflow.families.layers.GatedMLP`. The families differ
only in how config.json spells these things; each parses it into a :class:`LlamaMoEConfig`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout, ExpertSpec, Family
from moeflow.families.gated_experts import (
    ProjectionNames,
    detect_gated_layout,
    expert_linear_weights,
    read_gated_expert,
)
from moeflow.families.layers import Attention, GatedMLP, LinearFactory, PreNormLayer, RMSNorm
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

PROJECTIONS = ProjectionNames("gate_proj", "up_proj", "down_proj")
DENSE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # of the dense MLPs and shared experts


@dataclass
class LlamaMoEConfig:
    """What the engine and the decoder need, whichever family's config.json it came from."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # one routed expert
    norm_topk_prob: bool
    intermediate_size: int = 0  # the dense MLP layers
    moe_layer_ids: tuple[int, ...] = ()  # decoder layers holding an MoE block (the others are dense)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output is scaled by sigmoid(gate(x))
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head" (Qwen3), "projection" (OLMoE) or "head_after_rotary" (Hunyuan-A13B)
    clip_qkv: float | None = None
    layer_windows: tuple[int | None, ...] | None = None  # sliding window per layer (None: full attention)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    experts_key: str = "num_experts"  # the config.json key the expert count came from (for error messages)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                                  f"of num_key_value_heads={self.num_key_value_heads}")
        if not self.moe_layer_ids:
            raise CheckpointError("config.json: no decoder layer holds an MoE block (check decoder_sparse_step, "
                                  f"mlp_only_layers and {self.experts_key})")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                  f"[1, {self.experts_key}={self.num_experts}]")
        dense = [i for i in range(self.num_hidden_layers) if i not in self.moe_layer_ids]
        if dense and self.intermediate_size <= 0:
            raise CheckpointError(f"config.json: layers {dense} are dense MLP layers but intermediate_size is missing")


def require(raw: dict[str, Any], source: str, *keys: str) -> None:
    missing = [k for k in keys if raw.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")


def rope_theta(raw: dict[str, Any], source: str, default: float) -> float:
    """rope_theta from config.json (top level, or transformers 5.x's ``rope_parameters``); only plain rotary."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only the default rotary)")
    theta = raw.get("rope_theta", rope.get("rope_theta"))
    return float(theta) if theta is not None else default


def expert_count(raw: dict[str, Any], source: str, keys: tuple[str, ...]) -> tuple[int, str]:
    """(routed experts per layer, the key it was read from): published configs and transformers 5.x spell it
    differently (Qwen3: ``num_experts`` vs ``num_local_experts``); both present must agree."""
    found = {k: int(raw[k]) for k in keys if raw.get(k) is not None}
    if not found:
        raise CheckpointError(f"{source}: missing required field {' or '.join(keys)}")
    if len(set(found.values())) > 1:
        raise CheckpointError(f"{source}: {' and '.join(f'{k}={v}' for k, v in found.items())} disagree")
    key = next(iter(found))
    return found[key], key


def sparse_layers(num_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int] | None) -> tuple[int, ...]:
    """The decoder layers holding an MoE block: every ``sparse_step``-th one, except those in ``mlp_only``."""
    dense = set(mlp_only or ())
    step = max(int(sparse_step or 1), 1)
    return tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)


def common_fields(raw: dict[str, Any], source: str, rope_default: float = 10000.0) -> dict[str, Any]:
    """The fields every Llama-style config.json spells alike."""
    require(raw, source, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_experts_per_tok")
    heads = int(raw["num_attention_heads"])
    return dict(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(raw, source, rope_default),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def qwen_moe_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields Qwen2-MoE and Qwen3-MoE spell alike: the common ones, the expert count (``num_experts``, or
    ``num_local_experts`` as transformers 5.x writes Qwen3's), the expert and dense MLP sizes, and the MoE
    layers (``decoder_sparse_step``, ``mlp_only_layers``)."""
    fields = common_fields(raw, source)
    num_experts, key = expert_count(raw, source, ("num_experts", "num_local_experts"))
    require(raw, source, "moe_intermediate_size")
    return dict(fields, num_experts=num_experts, experts_key=key,
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                intermediate_size=int(raw.get("intermediate_size") or 0),
                moe_layer_ids=sparse_layers(fields["num_hidden_layers"], num_experts, raw.get("decoder_sparse_step", 1),
                                            raw.get("mlp_only_layers")))


class DecoderLayer(PreNormLayer):
    """Attention + (MoE block | dense gated MLP), pre-norm residual."""

    def __init__(self, cfg: LlamaMoEConfig, layer_idx: int, dtype: torch.dtype, linear_factory: LinearFactory,
                 router: RouterSpec):
        super().__init__()
        window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx,
            linear_factory, window, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm,
            norm_eps=cfg.rms_norm_eps, clip_qkv=cfg.clip_qkv, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if layer_idx in cfg.moe_layer_ids:
            shared = None
            if cfg.shared_expert_intermediate_size:
                shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, linear_factory, dtype,
                                  output_gate=cfg.shared_expert_gate)
            moe_idx = cfg.moe_layer_ids.index(layer_idx)  # the backend knows a block by its MoE index
            self.mlp = MoEBlock(cfg.hidden_size, cfg.num_experts, router, moe_idx, dtype, shared_expert=shared)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, linear_factory, dtype)

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None):
        x, h = self.attention_half(x, cos, sin, cache, cache_position, mask)
        return x + (self.mlp(h, experts, routing) if isinstance(self.mlp, MoEBlock) else self.mlp(h))


class SoftmaxRoutedFamily(Family):
    """A family with a softmax top-k router and SiLU-gated experts, read from config fields every Qwen-style
    config has (``moe_layer_ids``, ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``hidden_size``,
    ``moe_intermediate_size``): the Llama-MoE families and Qwen3-Next / Qwen3.5."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="softmax",
                          renormalize=self.config.norm_topk_prob)

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(self.config.hidden_size, self.config.moe_intermediate_size, activation="silu")


class LlamaMoEFamily(SoftmaxRoutedFamily):
    """A family whose checkpoints use the ``model.layers.L.{self_attn,mlp}`` names; subclasses parse config.json."""

    config: LlamaMoEConfig
    moe_prefix: ClassVar[str] = "mlp"

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg, router = self.config, self.router_spec()
        layers = [DecoderLayer(cfg, i, dtype, linear_factory, router) for i in range(cfg.num_hidden_layers)]
        windows = list(cfg.layer_windows) if cfg.layer_windows else None
        return CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.head_dim,
                             cfg.rope_theta, dtype, layer_windows=windows)

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        if param_path.startswith("lm_head."):
            return param_path
        return "model." + param_path.replace(".mlp.shared_expert.output_gate.", ".mlp.shared_expert_gate.")

    def _experts_base(self, moe_layer: int) -> str:
        return f"model.layers.{self.config.moe_layer_ids[moe_layer]}.{self.moe_prefix}.experts"

    def detect_expert_layout(self, reader: CheckpointReader) -> ExpertLayout:
        cfg = self.config
        return detect_gated_layout(reader, f"model.layers.{cfg.moe_layer_ids[0]}", self.moe_prefix, PROJECTIONS,
                                   cfg.num_experts, cfg.experts_key)

    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        return read_gated_expert(reader, layout, quant, self._experts_base(moe_layer), expert, PROJECTIONS,
                                 cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts)

    # ------------------------------------------------------------------ quantization (moeflow quantize)
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        return expert_linear_weights(name, reader, self.moe_prefix, PROJECTIONS)

    def attention_linear(self, name: str) -> str | None:
        """Attention projections, and the dense MLPs and shared experts built by the same linear factory
        (they are quantized together, as published AWQ/GPTQ checkpoints of these families do)."""
        parts = name.split(".")
        if len(parts) >= 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight" and (
                parts[3:-1] in (["mlp", p] for p in DENSE_PROJECTIONS)
                or parts[3:-1] in (["mlp", "shared_expert", p] for p in DENSE_PROJECTIONS)):
            return ".".join(parts[:-1])
        return super().attention_linear(name)
