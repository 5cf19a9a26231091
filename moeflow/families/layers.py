"""Building blocks shared by the families' decoders: RMSNorm, rotary embeddings, AWQ linear, GQA attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H]: normalise in fp32, then scale in the input dtype (as transformers does)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin) [B, T, head_dim], computed in fp32."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class AWQLinear(nn.Module):
    """A bias-free linear layer holding AWQ GEMM-layout 4-bit weights; computes ``x @ W``."""

    def __init__(self, in_features: int, out_features: int, group_size: int, scales_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        g = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(g, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(g, out_features, dtype=scales_dtype))
        self.kernels_backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: fp32 accumulation, output in the dtype of x."""
        flat = x.reshape(-1, self.in_features)
        y = kernels.awq_linear(flat, self.qweight, self.qzeros, self.scales, self.group_size,
                               backend=self.kernels_backend)
        return y.reshape(*x.shape[:-1], self.out_features)


def _sdpa_has_gqa() -> bool:
    """torch >= 2.5 takes ``enable_gqa`` in scaled_dot_product_attention."""
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


_SDPA_GQA = _sdpa_has_gqa()

LinearFactory = Callable[[str, int, int], nn.Module]  # (name, fan_in, fan_out) -> a linear module


class Attention(nn.Module):
    """Rotary grouped-query attention over a static KV cache (Llama/Mixtral layout: q/k/v/o projections)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 linear_factory: LinearFactory, sliding_window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        h = hidden_size
        self.q_proj = linear_factory("q_proj", h, self.n_heads * self.head_dim)
        self.k_proj = linear_factory("k_proj", h, self.n_kv * self.head_dim)
        self.v_proj = linear_factory("v_proj", h, self.n_kv * self.head_dim)
        self.o_proj = linear_factory("o_proj", self.n_heads * self.head_dim, h)
        self.sliding_window = sliding_window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
        cache_position: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; cache: the engine's KV cache (``update(layer, k, v, cache_position)``);
        mask bool [B, 1, T, max_len]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
        groups = self.n_heads // self.n_kv
        if groups > 1 and _SDPA_GQA:  # each kv head serves its query heads inside the kernel: no copy of the cache
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        else:
            if groups > 1:  # torch without enable_gqa: share the kv heads by copying them
                k_all = k_all.repeat_interleave(groups, dim=1)
                v_all = v_all.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
