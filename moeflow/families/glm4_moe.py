"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``glm4_moe``): grouped-query attention with partial rotary, q/k/v biases and
optional per-head QK-norm; DeepSeek-V3's MoE side (sigmoid router with ``e_score_correction_bias``, shared
experts, dense first layers; :mod:`.deepseek_moe`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder
from moeflow.families.deepseek_moe import (
    MoEDecoderLayer,
    SharedExpertMoEConfig,
    SharedExpertMoEFamily,
    sigmoid_router_spec,
)
from moeflow.families.layers import LinearFactory, RMSNorm, apply_rotary, attend_in_place, project_qkv
from moeflow.moe.routing import RouterSpec


@dataclass
class Glm4MoeConfig(SharedExpertMoEConfig):
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False  # an o_proj bias too (dots1: its attention_bias covers all four projections)
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers past num_hidden_layers (families/mtp.py)
    model_type: ClassVar[str] = "glm4_moe"  # named in errors (the configs built on this one set theirs)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.n_shared_experts = self.n_shared_experts or 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> Glm4MoeConfig:
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        for key in ("rope_theta", "partial_rotary_factor"):  # rope_parameters' first, as transformers 5.x reads them
            if rope.get(key) is not None:  # (5.17's config.json also writes a stale top-level partial_rotary_factor)
                d[key] = rope[key]
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        if kind != "default":
            raise CheckpointError(f"{source}: rope type {kind!r} is not supported for {cls.model_type} (only the "
                                  f"default)")
        cfg = cls(**cls.known_entries(d, source))
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError(f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={cfg.num_key_value_heads}")
        if cfg.hidden_act != "silu":
            raise CheckpointError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported (silu)")
        if not 0 <= cfg.first_k_dense_replace < cfg.num_hidden_layers:
            raise CheckpointError(f"{source}: first_k_dense_replace={cfg.first_k_dense_replace} leaves no MoE layer")
        if cfg.rotary_dim % 2:
            raise CheckpointError(f"{source}: partial_rotary_factor={cfg.partial_rotary_factor} x head_dim="
                                  f"{cfg.head_dim} is not an even rotary size")
        return cfg


class PartialRotaryAttention(nn.Module):
    """Grouped-query attention whose rotary turns only the first ``rotary_dim`` values of each head, with
    optional q/k/v biases and per-head RMS QK-norm (``q_norm``/``k_norm``, before the rotary)."""

    def __init__(self, cfg: Glm4MoeConfig, layer_idx: int, linear_factory: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = linear_factory("q_proj", h, self.n_heads * self.head_dim)
        self.k_proj = linear_factory("k_proj", h, self.n_kv * self.head_dim)
        self.v_proj = linear_factory("v_proj", h, self.n_kv * self.head_dim)
        self.o_proj = linear_factory("o_proj", self.n_heads * self.head_dim, h)
        if cfg.attention_bias:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                if not isinstance(proj, nn.Linear):
                    raise CheckpointError("glm4_moe: quantized q/k/v projections with attention_bias=true are not "
                                          "supported (the AWQ linear carries no bias)")
                proj.bias = nn.Parameter(torch.zeros(proj.out_features, dtype=dtype))
        if cfg.o_bias:
            if not isinstance(self.o_proj, nn.Linear):
                raise CheckpointError("quantized o_proj with an attention bias is not supported (the AWQ linear "
                                      "carries no bias)")
            self.o_proj.bias = nn.Parameter(torch.zeros(self.o_proj.out_features, dtype=dtype))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.use_qk_norm else None
        # q/k/v as one packed AWQ matrix on the Triton path (set at load: layers.fuse_qkv_projections)
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        self.fused_qkv = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; cos/sin [B, T, rotary_dim]; mask bool [B, 1, T, max_len] -> [B, T, H]."""
        b, t, _ = x.shape
        q, k, v = project_qkv(self, x)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        out = attend_in_place(cache, self.layer_idx, q, k, v, cache_position, None)
        if out is None:
            k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                                 enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Glm4MoeFamily(SharedExpertMoEFamily):
    name = "glm4_moe"
    model_types = ("glm4_moe",)
    config: Glm4MoeConfig
    config_class: ClassVar[type[Glm4MoeConfig]] = Glm4MoeConfig

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Glm4MoeConfig:
        cfg = cls.config_class.from_dict(raw, source)
        sigmoid_router_spec(cfg, source)  # checks the groups
        return cfg

    def router_spec(self) -> RouterSpec:
        return sigmoid_router_spec(self.config, "config.json")

    def mtp_attention(self, cache_layer: int, dtype: torch.dtype, linear_factory: LinearFactory) -> nn.Module:
        return PartialRotaryAttention(self.config, cache_layer, linear_factory, dtype)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg = self.config
        layers = [MoEDecoderLayer(PartialRotaryAttention(cfg, i, linear_factory, dtype), self.build_mlp(i, dtype),
                                  cfg.hidden_size, cfg.rms_norm_eps, dtype) for i in range(cfg.num_hidden_layers)]
        return CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.rotary_dim,
                             cfg.rope_theta, dtype)
