"""The Mixtral decoder: embeddings, RMSNorm, rotary GQA attention with a static KV cache, MoE blocks, LM head.

Expert weights are not parameters of this module: each :class:`~moeflow.moe.MoEBlock` reaches them
through its expert backend (all resident, or offloaded by the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.models.kv_cache import StaticKVCache
from moeflow.models.layers import AWQLinear, RMSNorm, RotaryEmbedding, apply_rotary
from moeflow.moe import MoEBlock
from moeflow.moe.backend import StepInfo


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


class Attention(nn.Module):
    def __init__(self, cfg: MixtralConfig, layer_idx: int, linear_factory):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = linear_factory("q_proj", h, self.n_heads * self.head_dim)
        self.k_proj = linear_factory("k_proj", h, self.n_kv * self.head_dim)
        self.v_proj = linear_factory("v_proj", h, self.n_kv * self.head_dim)
        self.o_proj = linear_factory("o_proj", self.n_heads * self.head_dim, h)
        self.sliding_window = cfg.sliding_window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
        cache_position: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; mask bool [B, 1, T, max_len]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
        groups = self.n_heads // self.n_kv
        if groups > 1:  # grouped-query attention: share each kv head across its query heads
            k_all = k_all.repeat_interleave(groups, dim=1)
            v_all = v_all.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MixtralConfig, layer_idx: int, dtype: torch.dtype, linear_factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, linear_factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.block_sparse_moe = MoEBlock(
            cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, layer_idx, dtype
        )

    def forward(self, x, cos, sin, cache, cache_position, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_position, mask)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MixtralModel(nn.Module):
    """Decoder stack plus LM head. ``awq_attention``: the attention projections are AWQ 4-bit."""

    def __init__(self, cfg: MixtralConfig, dtype: torch.dtype, awq_attention: dict | None = None):
        super().__init__()
        self.config = cfg

        def linear_factory(name: str, fan_in: int, fan_out: int) -> nn.Module:
            if awq_attention is not None:
                return AWQLinear(fan_in, fan_out, awq_attention["group_size"], awq_attention["scales_dtype"])
            return nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)

        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, linear_factory) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticKVCache,
        cache_position: torch.Tensor, token_mask: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids/position_ids [B, T], cache_position [T], token_mask bool [B, T] -> logits fp32 [B, T, V]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        cache.mark_valid(cache_position, token_mask)
        cache.record_ids(cache_position, input_ids)
        history_ids, history_mask = cache.history(cache_position)
        phase = "prefill" if input_ids.shape[1] > 1 else "decode"
        rows = getattr(cache, "rows", None)
        self.layers[0].block_sparse_moe.experts.begin_step(StepInfo(
            input_ids, position_ids, token_mask, phase, rows=rows if isinstance(rows, torch.Tensor) else None,
            embeds=x, history_ids=history_ids, history_mask=history_mask))
        mask = cache.attention_mask(cache_position, self.config.sliding_window)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, cache_position, mask)
        return self.lm_head(self.norm(x)).float()
