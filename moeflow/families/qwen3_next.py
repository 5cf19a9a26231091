"""Qwen3-Next (``qwen3_next``: Qwen3-Next-80B-A3B) and Qwen3.5-MoE (``qwen3_5_moe``: Qwen3.5-35B-A3B, 122B-A10B,
397B-A17B; its text model): hybrid linear-attention MoE decoders.

Layers follow ``layer_types`` (or every ``full_attention_interval``-th layer full attention, the others linear):

* ``linear_attention``: a Gated DeltaNet (:mod:`moeflow.families.gated_deltanet`); Qwen3-Next fuses its input
  projections (``in_proj_qkvz``, ``in_proj_ba``, grouped by key head), Qwen3.5 keeps them apart
  (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``);
* ``full_attention``: gated attention: ``q_proj`` yields each head's query and an output gate, the output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``; zero-centred QK-norm per head; rotary on the first
  ``partial_rotary_factor`` of each head (Qwen3.5's M-RoPE sections all carry the token's position for text,
  which is this same rotary).

Every layer's MLP is an MoE block (softmax top-k, renormalised; a shared expert scaled by
``sigmoid(shared_expert_gate(x))``) except Qwen3-Next's ``mlp_only_layers`` / ``decoder_sparse_step`` dense ones.
Norms are zero-centred (``1 + w``). The full-attention layers keep a KV cache, the linear ones a fixed-size state
(:mod:`moeflow.engine.linear_state`). Qwen3.5 is published as a vision-language model: its config.json nests the
text model's fields in ``text_config`` and its weights under ``model.language_model.``; moeflow reads the text
model only (vision weights are never read); ``from_pretrained(mtp=True)`` reads the multi-token-prediction
layer (:mod:`moeflow.families.qwen3_next_mtp`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout, KVCacheSpec, LinearStateSpec
from moeflow.families.gated_deltanet import DeltaNetShape, GatedDeltaNet, ZeroCenteredRMSNorm
from moeflow.families.gated_experts import (
    ProjectionNames,
    detect_gated_layout,
    expert_linear_weights,
    read_gated_expert,
)
from moeflow.families.layers import (
    GatedMLP,
    LinearFactory,
    RotaryEmbedding,
    attend_in_place,
    make_linear,
    rotate_half,
)
from moeflow.families.llama_moe import SoftmaxRoutedFamily, expert_count, require, rope_theta, sparse_layers
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.families.qwen3_next_mtp import MTP_FIELD, build_qwen_mtp, mtp_expert_base, qwen_mtp_checkpoint_name
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

PROJECTIONS = ProjectionNames("gate_proj", "up_proj", "down_proj")
LAYER_TYPES = ("linear_attention", "full_attention")
TEXT_PREFIXES = ("model.language_model", "model")  # Qwen3.5 as published, then a text-only checkpoint


@dataclass
class HybridMoEConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    partial_rotary_factor: float
    rope_theta: float
    moe_layer_ids: tuple[int, ...]
    intermediate_size: int = 0
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0  # the checkpoint's multi-token-prediction layers (families/qwen3_next_mtp.py)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def deltanet_shape(self, fused: bool) -> DeltaNetShape:
        return DeltaNetShape(self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads,
                             self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim,
                             fused, self.rms_norm_eps)


def parse_hybrid(raw: dict[str, Any], source: str, model_type: str, dense_layers: bool) -> HybridMoEConfig:
    """The text model's config.json fields -> :class:`HybridMoEConfig`, refusing by name what is not supported.
    ``dense_layers``: ``mlp_only_layers`` / ``decoder_sparse_step`` may leave layers dense (Qwen3-Next)."""
    require(raw, source, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_experts_per_tok", "moe_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim")
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad or len(types) != layers:
        raise CheckpointError(f"{source}: layer_types must list one of {LAYER_TYPES} for each of num_hidden_layers="
                              f"{layers} layers ({model_type}); got {len(types)} entries" +
                              (f" with {bad}" if bad else ""))
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported for {model_type} (silu)")
    if raw.get("attn_output_gate", True) is not True:
        raise CheckpointError(f"{source}: attn_output_gate={raw['attn_output_gate']!r} is not supported for "
                              f"{model_type} (the attention output is always gated)")
    num_experts, key = expert_count(raw, source, ("num_experts",))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    # rope_parameters' factor first, as transformers 5.x's model reads it (5.17's config.json also writes a stale
    # top-level default 0.25 beside it); a config without one (published, pre-5.x): the top-level field
    partial = float(next((f for f in (rope.get("partial_rotary_factor"), raw.get("partial_rotary_factor"))
                          if f is not None), 0.25))
    nk, nv = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
    kernel = int(raw.get("linear_conv_kernel_dim", 4))
    if nv % nk:
        raise CheckpointError(f"{source}: linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}")
    if kernel < 2:
        raise CheckpointError(f"{source}: linear_conv_kernel_dim={kernel} is not supported (>= 2)")
    if dense_layers:
        moe_ids = sparse_layers(layers, num_experts, raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers"))
    else:
        moe_ids = tuple(range(layers))
    if not moe_ids:
        raise CheckpointError(f"{source}: no decoder layer holds an MoE block (check decoder_sparse_step, "
                              f"mlp_only_layers and {key})")
    if len(moe_ids) < layers and not raw.get("intermediate_size"):
        raise CheckpointError(f"{source}: some layers are dense MLP layers but intermediate_size is missing")
    cfg = HybridMoEConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads), layer_types=tuple(types),
        linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=int(raw["linear_key_head_dim"]),
        linear_value_head_dim=int(raw["linear_value_head_dim"]), linear_conv_kernel_dim=kernel,
        num_experts=num_experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if dense_layers else True,
        partial_rotary_factor=partial, rope_theta=rope_theta(raw, source, 10000.0), moe_layer_ids=moe_ids,
        intermediate_size=int(raw.get("intermediate_size") or 0), attention_bias=bool(raw.get("attention_bias")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"),
        mtp_num_hidden_layers=int(raw.get("mtp_num_hidden_layers") or 0))
    if not 1 <= cfg.num_experts_per_tok <= num_experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} must lie in [1, {key}="
                              f"{num_experts}]")
    if heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                              f"{cfg.num_key_value_heads}")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise CheckpointError(f"{source}: partial_rotary_factor={partial} gives a rotary dimension of "
                              f"{cfg.rotary_dim} for head_dim={cfg.head_dim} (an even number in (0, head_dim])")
    return cfg


# ------------------------------------------------------------------ the decoder
class GatedAttention(nn.Module):
    """Grouped-query attention whose ``q_proj`` also yields an output gate per head (Qwen3-Next's full attention):
    ``o_proj(attn * sigmoid(gate))``; zero-centred QK-norm per head; rotary on the first ``rotary_dim`` values.
    ``kv_idx``: the layer's index among the full-attention layers (its place in the KV cache)."""

    def __init__(self, cfg: HybridMoEConfig, kv_idx: int, linear_factory: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.kv_idx = kv_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = make_linear(linear_factory, "q_proj", h, 2 * self.n_heads * d, bias)
        self.k_proj = make_linear(linear_factory, "k_proj", h, self.n_kv * d, bias)
        self.v_proj = make_linear(linear_factory, "v_proj", h, self.n_kv * d, bias)
        self.o_proj = make_linear(linear_factory, "o_proj", self.n_heads * d, h, bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the first cos.shape[-1] values of each head: x [B, heads, T, D], cos/sin [B, T, rotary]."""
        r = cos.shape[-1]
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos[:, None] + rotate_half(rot) * sin[:, None], rest), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; mask bool [B, 1, T, keys]."""
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        out = attend_in_place(cache, self.kv_idx, q, k, v, cache_position, None, scale=self.head_dim ** -0.5)
        if out is None:
            k_all, v_all = cache.update(self.kv_idx, k, v, cache_position)
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=self.head_dim ** -0.5,
                                                 enable_gqa=self.n_heads != self.n_kv)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, t, -1)))


class HybridDecoderLayer(nn.Module):
    """(Gated DeltaNet | gated attention) + (MoE block | dense MLP), pre-norm residual, zero-centred norms."""

    def __init__(self, cfg: HybridMoEConfig, layer_idx: int, fused: bool, dtype: torch.dtype,
                 linear_factory: LinearFactory, router: RouterSpec):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if cfg.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.deltanet_shape(fused), cfg.linear_layers.index(layer_idx),
                                             linear_factory, dtype)
        else:
            self.self_attn = GatedAttention(cfg, cfg.full_layers.index(layer_idx), linear_factory, dtype)
        self.mlp: nn.Module
        if layer_idx in cfg.moe_layer_ids:
            shared = None
            if cfg.shared_expert_intermediate_size:
                shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, linear_factory, dtype,
                                  output_gate=True)
            self.mlp = MoEBlock(cfg.hidden_size, cfg.num_experts, router, cfg.moe_layer_ids.index(layer_idx), dtype,
                                shared_expert=shared)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, linear_factory, dtype)

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None):
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(h, cache)
        else:
            x = x + self.self_attn(h, cos, sin, cache, cache_position, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, experts, routing) if isinstance(self.mlp, MoEBlock) else self.mlp(h))


@dataclass(frozen=True)
class TextLayout(ExpertLayout):
    """The expert layout, and the prefix of the text model's weights (``model`` or ``model.language_model``)."""

    text_prefix: str = "model"


class Qwen3NextFamily(SoftmaxRoutedFamily):
    """Qwen3-Next; :class:`Qwen35MoeFamily` reads Qwen3.5-MoE's config and projection names over it."""

    name = "qwen3_next"
    model_types = ("qwen3_next",)
    fused_projections: ClassVar[bool] = True
    config: HybridMoEConfig

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HybridMoEConfig:
        return parse_hybrid(raw, source, "qwen3_next", dense_layers=True)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg, router = self.config, self.router_spec()
        layers = [HybridDecoderLayer(cfg, i, self.fused_projections, dtype, linear_factory, router)
                  for i in range(cfg.num_hidden_layers)]
        decoder = CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.head_dim,
                                cfg.rope_theta, dtype)
        decoder.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        decoder.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        return decoder

    # ------------------------------------------------------------------ multi-token prediction
    mtp_config_field = MTP_FIELD

    def num_mtp_layers(self) -> int:
        return self.config.mtp_num_hidden_layers

    def build_mtp(self, dtype: torch.dtype, linear_factory: LinearFactory) -> MultiTokenPredictor:
        return build_qwen_mtp(self.config, lambda ext, idx: HybridDecoderLayer(
            ext, idx, self.fused_projections, dtype, linear_factory, self.router_spec()), dtype)

    def mtp_checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        return qwen_mtp_checkpoint_name(param_path)

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.config
        shape = cfg.deltanet_shape(self.fused_projections)
        linear = LinearStateSpec(len(cfg.linear_layers), shape.conv_dim, shape.conv_kernel, shape.num_v_heads,
                                 shape.k_head_dim, shape.v_head_dim)
        return KVCacheSpec(len(cfg.full_layers), cfg.num_key_value_heads, cfg.head_dim, linear=linear)

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        if param_path.startswith("lm_head."):
            return param_path
        prefix = layout.text_prefix if isinstance(layout, TextLayout) else "model"
        return f"{prefix}." + param_path.replace(".mlp.shared_expert.output_gate.", ".mlp.shared_expert_gate.")

    def detect_expert_layout(self, reader: CheckpointReader) -> TextLayout:
        prefix = next((p for p in TEXT_PREFIXES if f"{p}.embed_tokens.weight" in reader), None)
        if prefix is None:
            raise CheckpointError(f"no text-model weights in {reader.directory}: expected "
                                  + " or ".join(f"'{p}.embed_tokens.weight'" for p in TEXT_PREFIXES))
        cfg = self.config
        found = detect_gated_layout(reader, f"{prefix}.layers.{cfg.moe_layer_ids[0]}", "mlp", PROJECTIONS,
                                    cfg.num_experts, "num_experts")
        return TextLayout(found.prefix, found.fused, found.awq, found.scales_dtype, found.mxfp4, text_prefix=prefix)

    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        prefix = layout.text_prefix if isinstance(layout, TextLayout) else "model"
        base = mtp_expert_base(cfg, prefix, moe_layer)
        return read_gated_expert(reader, layout, quant, base, expert, PROJECTIONS, cfg.hidden_size,
                                 cfg.moe_intermediate_size, cfg.num_experts)

    # ------------------------------------------------------------------ quantization (moeflow quantize)
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Routed experts (per expert or fused), under ``model.layers``, Qwen3.5's ``model.language_model.layers``
        or the MTP layer's ``mtp.layers``."""
        nested = "model.language_model."
        if name.startswith("mtp.layers."):  # the MTP layer's experts (quantized as the decoder's)
            found = expert_linear_weights("model." + name[len("mtp."):], _Renamed(reader, name), "mlp", PROJECTIONS)
            return None if found is None else (("mtp." + n[len("model."):], w) for n, w in found)
        if not name.startswith(nested):
            return expert_linear_weights(name, reader, "mlp", PROJECTIONS)
        found = expert_linear_weights("model." + name[len(nested):], _Renamed(reader, name), "mlp", PROJECTIONS)
        return None if found is None else ((nested + n[len("model."):], w) for n, w in found)

    def attention_linear(self, name: str) -> str | None:
        """None: ``moeflow quantize --attention`` keeps these models' projections in 16 bits (the engine detects AWQ
        attention on layer 0, a linear-attention layer here)."""
        return None


class _Renamed:
    """A reader whose ``get`` of any name reads ``real`` (expert_linear_weights reads the one name it matched)."""

    def __init__(self, reader: CheckpointReader, real: str) -> None:
        self.reader, self.real = reader, real

    def get(self, name: str, *args: Any) -> torch.Tensor:
        return self.reader.get(self.real, *args)


class Qwen35MoeFamily(Qwen3NextFamily):
    """Qwen3.5-MoE's text model: the config.json of ``Qwen3_5MoeForConditionalGeneration`` (fields under
    ``text_config``) or of ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``); separate DeltaNet projections; every
    layer an MoE layer, top-k always renormalised."""

    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    fused_projections = False

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HybridMoEConfig:
        text = raw.get("text_config")
        if raw.get("model_type") == "qwen3_5_moe":
            if not isinstance(text, dict):
                raise CheckpointError(f"{source}: model_type 'qwen3_5_moe' keeps the text model's fields in "
                                      "text_config, which is missing")
            # the top level decides what the conditional-generation model ties and stops on
            top = {k: raw[k] for k in ("tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id")
                   if raw.get(k) is not None}
            raw = {**text, **top}
        return parse_hybrid(raw, source, "qwen3_5_moe", dense_layers=False)
