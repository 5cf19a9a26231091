"""DeepSeek-V2 / V2-Lite (``deepseek_v2``) and DeepSeek-V3 / R1 / V3.1, Kimi-K2, GLM-4.7-Flash (``deepseek_v3``,
``kimi_k2``, ``glm4_moe_lite``).

Decoder layers: multi-head latent attention (:mod:`moeflow.families.mla`), then a dense MLP in the first
``first_k_dense_replace`` layers and an MoE block with shared experts after (:mod:`.deepseek_moe`).
Routing: V2 softmax with ``topk_method`` ``greedy`` or ``group_limited_greedy`` (a group scored by its best
expert); V3 sigmoid with ``e_score_correction_bias`` and groups scored by their top-2 (``noaux_tc``).
The KV cache keeps the compressed latent (``kv_lora_rank + qk_rope_head_dim`` values per token per layer);
set ``family.latent_kv_cache = False`` to keep full heads instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, KVCacheSpec
from moeflow.families.deepseek_moe import (
    MoEDecoderLayer,
    SharedExpertMoEConfig,
    SharedExpertMoEFamily,
    check_groups,
    sigmoid_router_spec,
)
from moeflow.families.layers import LinearFactory
from moeflow.families.mla import LatentAttention, MLAShape, rotary_from_config
from moeflow.moe.routing import RouterSpec

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass
class DeepSeekConfig(SharedExpertMoEConfig):
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    # filled in: the engine's generic fields (full-head sizes, for estimates) and the model type read
    num_key_value_heads: int = 0
    head_dim: int = 0
    model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        self.n_shared_experts = self.n_shared_experts or 0
        self.n_group = self.n_group or 1
        self.topk_group = self.topk_group or 1
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> DeepSeekConfig:
        d = dict(d)
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        d["rope_scaling"] = rope
        if d.get("rope_theta") is None:
            d.pop("rope_theta", None)
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
                                  f"with multi-head latent attention (the rotary turns all qk_rope_head_dim values)")
        kinds = d.get("mlp_layer_types")  # GLM-4.7-Flash (glm4_moe_lite): "dense" / "sparse" per layer
        if kinds is not None:
            dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
            if any(kind != "sparse" for kind in kinds[dense:]) or len(kinds) != d.get("num_hidden_layers"):
                raise CheckpointError(f"{source}: mlp_layer_types={kinds} is not dense layers followed by sparse "
                                      f"(MoE) ones for every one of num_hidden_layers={d.get('num_hidden_layers')}")
            d["first_k_dense_replace"] = dense
        return cls(**cls.known_entries(d, source, MLA_FIELDS, derived=("num_key_value_heads", "head_dim")))


def check_common(cfg: DeepSeekConfig, source: str) -> None:
    if cfg.moe_layer_freq != 1:
        raise CheckpointError(f"{source}: moe_layer_freq={cfg.moe_layer_freq} is not supported (1: every layer past "
                              "first_k_dense_replace is an MoE layer)")
    if not 0 <= cfg.first_k_dense_replace < cfg.num_hidden_layers:
        raise CheckpointError(f"{source}: first_k_dense_replace={cfg.first_k_dense_replace} leaves no MoE layer "
                              f"(num_hidden_layers={cfg.num_hidden_layers})")
    if cfg.hidden_act != "silu":
        raise CheckpointError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported (silu)")
    if cfg.attention_bias:
        raise CheckpointError(f"{source}: attention_bias=true is not supported for multi-head latent attention")


class DeepSeekFamily(SharedExpertMoEFamily):
    """The parts DeepSeek-V2 and V3 share (MLA decoder, latent cache); subclasses pick the router."""

    config: DeepSeekConfig
    config_class: ClassVar[type[DeepSeekConfig]] = DeepSeekConfig  # (DeepSeek-V3.2's adds its indexer's fields)
    interleaved_rope_always: ClassVar[bool] = False  # V2's rotary is always on interleaved pairs

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__(config)
        self.latent_kv_cache = True  # False: the engine's full-head cache (for comparisons)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DeepSeekConfig:
        cfg = cls.config_class.from_dict(raw, source)
        check_common(cfg, source)
        return cfg

    def mla_shape(self, softmax_mult: float = 1.0) -> MLAShape:
        cfg = self.config
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return MLAShape(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                        cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        rope_interleave=self.interleaved_rope_always or bool(cfg.rope_interleave),
                        softmax_scale=qk ** -0.5 * softmax_mult)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg = self.config
        rotary, softmax_mult = rotary_from_config(cfg.rope_scaling or {}, cfg.qk_rope_head_dim, cfg.rope_theta,
                                                  cfg.max_position_embeddings, "config.json")
        shape = self.mla_shape(softmax_mult)
        layers = [MoEDecoderLayer(LatentAttention(shape, i, linear_factory, dtype), self.build_mlp(i, dtype),
                                  cfg.hidden_size, cfg.rms_norm_eps, dtype) for i in range(cfg.num_hidden_layers)]
        decoder = CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.qk_rope_head_dim,
                                cfg.rope_theta, dtype)
        decoder.rotary = rotary
        return decoder

    def mtp_attention(self, cache_layer: int, dtype: torch.dtype, linear_factory: LinearFactory) -> LatentAttention:
        cfg = self.config
        _, softmax_mult = rotary_from_config(cfg.rope_scaling or {}, cfg.qk_rope_head_dim, cfg.rope_theta,
                                             cfg.max_position_embeddings, "config.json")
        return LatentAttention(self.mla_shape(softmax_mult), cache_layer, linear_factory, dtype)

    def attention_linear(self, name: str) -> str | None:
        """None: ``moeflow quantize --attention`` keeps MLA's projections in 16 bits (``kv_b_proj`` is read
        dense to be absorbed, and the engine detects AWQ attention by ``q_proj`` alone)."""
        return None

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg, shape = self.config, self.mla_shape()
        if self.latent_kv_cache:
            return KVCacheSpec(cfg.num_hidden_layers, latent_dim=shape.latent_dim)
        return KVCacheSpec(cfg.num_hidden_layers, cfg.num_attention_heads, shape.padded_head_dim)


class DeepSeekV3Family(DeepSeekFamily):
    """DeepSeek-V3 / R1 / V3.1, Kimi-K2 and GLM-4.7-Flash (same architecture; Kimi-K2's config says ``kimi_k2``,
    GLM-4.7-Flash's ``glm4_moe_lite`` with ``mlp_layer_types`` for ``first_k_dense_replace``)."""

    name = "deepseek_v3"
    model_types = ("deepseek_v3", "kimi_k2", "glm4_moe_lite")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DeepSeekConfig:
        cfg = super().parse_config(raw, source)
        method = raw.get("topk_method", "noaux_tc")
        if method != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"{source}: DeepSeek-V3 routing is topk_method='noaux_tc' with scoring_func="
                                  f"'sigmoid'; got topk_method={method!r}, scoring_func={raw.get('scoring_func')!r}")
        if "norm_topk_prob" not in raw:
            cfg.norm_topk_prob = True  # transformers' and DeepSeek-V3's default
        check_groups(cfg, source)
        return cfg

    def router_spec(self) -> RouterSpec:
        return sigmoid_router_spec(self.config, "config.json")


class DeepSeekV2Family(DeepSeekFamily):
    """DeepSeek-V2 / V2-Lite / V2.5: softmax routing, ``greedy`` or ``group_limited_greedy``."""

    name = "deepseek_v2"
    model_types = ("deepseek_v2",)
    interleaved_rope_always = True

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DeepSeekConfig:
        cfg = super().parse_config(raw, source)
        if cfg.topk_method not in V2_TOPK_METHODS:
            raise CheckpointError(f"{source}: topk_method={cfg.topk_method!r} is not a DeepSeek-V2 method "
                                  f"({', '.join(V2_TOPK_METHODS)})")
        if cfg.topk_method == "greedy":
            cfg.n_group = cfg.topk_group = 1
        check_groups(cfg, source)
        return cfg

    def router_spec(self) -> RouterSpec:
        cfg = self.config
        return RouterSpec(top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=bool(cfg.norm_topk_prob),
                          n_groups=cfg.n_group, topk_groups=cfg.topk_group, group_score="max",
                          scaling_factor=float(cfg.routed_scaling_factor))
