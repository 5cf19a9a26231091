"""gpt-oss's decoder pieces: YaRN rotary, its RMSNorm, and grouped-query attention with per-head sinks.

* YaRN (arXiv 2309.00071) as transformers computes it (``rope_type == "yarn"``): inverse frequencies blended
  between interpolated and extrapolated ones by a linear ramp over the dimensions whose rotation count lies
  between ``beta_slow`` and ``beta_fast`` at ``original_max_position_embeddings`` (floored/ceiled unless
  ``truncate`` is false), and cos/sin scaled by the attention factor ``0.1 ln(factor) + 1``.
* Sinks: one learnt logit per head joins the softmax over the keys and is dropped afterwards, so a head can
  attend to "nothing". SDPA has no such input, so attention is written out (scores, mask, sink column,
  max-subtracted softmax in the activation dtype, as transformers' reference does).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.layers import LinearFactory, RMSNorm, apply_rotary, attend_in_place
from moeflow.kernels.cpu.gpt_oss_step import sink_attention_step
from moeflow.kernels.cpu.step import rmsnorm


def yarn_inv_freq(head_dim: int, theta: float, rope: dict[str, Any], max_position_embeddings: int,
                  source: str = "config.json") -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim/2], attention factor) of a YaRN rope config (``rope_scaling`` / ``rope_parameters``)."""
    try:
        original = int(rope["original_max_position_embeddings"])
    except KeyError:
        raise CheckpointError(f"{source}: YaRN rope needs rope_scaling.original_max_position_embeddings") from None
    factor = rope.get("factor") or max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all
                            else get_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    dim = head_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class ScaledRotaryEmbedding(nn.Module):
    """Rotary embedding from given inverse frequencies, cos/sin multiplied by ``attention_factor`` (YaRN)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin) [B, T, head_dim] (both halves repeated), computed in fp32."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


class GptOssRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H]: normalise and scale in fp32, then cast (gpt-oss keeps its norms in fp32). ``native`` (the
        CPU step, engine.cpu_layers_gpt_oss): one call into moeflow's CPU library for contiguous fp32 x."""
        if self.native and x.dtype == torch.float32 and x.is_contiguous():
            return rmsnorm(x, self.weight, self.eps)[0]
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def biased(linear: nn.Module, name: str, dtype: torch.dtype) -> nn.Module:
    """The factory's linear with a bias added (gpt-oss's attention projections carry biases)."""
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"gpt-oss attention {name}: only dense projections are supported (got "
                              f"{type(linear).__name__}; quantize the experts only)")
    linear.bias = nn.Parameter(torch.zeros(linear.out_features, dtype=dtype, device=linear.weight.device))
    return linear


class SinkAttention(nn.Module):
    """Rotary grouped-query attention with biased q/k/v/o projections and one sink logit per head."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 linear_factory: LinearFactory, dtype: torch.dtype, sliding_window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim ** -0.5
        self.q_proj = biased(linear_factory("q_proj", hidden_size, num_heads * head_dim), "q_proj", dtype)
        self.k_proj = biased(linear_factory("k_proj", hidden_size, num_kv_heads * head_dim), "k_proj", dtype)
        self.v_proj = biased(linear_factory("v_proj", hidden_size, num_kv_heads * head_dim), "v_proj", dtype)
        self.o_proj = biased(linear_factory("o_proj", num_heads * head_dim, hidden_size), "o_proj", dtype)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=dtype))
        self.sliding_window = sliding_window
        self.native = False  # one-token steps' attention as one call (the CPU step; engine.cpu_layers_gpt_oss)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
        cache_position: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; mask bool [B, 1, T, max_len] (this layer's: sliding or full)."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.native:
            out = self._native_step(q, k, v, cos, sin, cache, cache_position, mask)
            if out is not None:
                return self.o_proj(out.view(b, t, -1))
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend_in_place(cache, self.layer_idx, q, k, v, cache_position, self.sliding_window, self.sinks,
                              self.scaling)
        if out is None:
            k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
            out = sink_attention(q, k_all, v_all, mask, self.sinks, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _native_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: Any, cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """One token's attention (q [1, 1, nh D], k, v [1, 1, nkv D] projected) as the one-call CPU step computes
        it (:func:`~moeflow.kernels.cpu.gpt_oss_step.sink_attention_step`: the cache written, out fp32 [nh D]), or
        None where it does not apply (more tokens, not fp32, not the engine's static cache)."""
        layer_kv = getattr(cache, "layer_kv", None)
        if layer_kv is None or q.shape[:2] != (1, 1) or q.dtype != torch.float32:
            return None
        k_cache, v_cache = layer_kv[self.layer_idx]
        tensors = (q, k, v, cos, sin, k_cache, v_cache, mask, self.sinks)
        if k_cache.dtype != torch.float32 or k_cache.shape[0] != 1 or mask.dtype != torch.bool \
                or mask.numel() != k_cache.shape[2] or cos.numel() != self.head_dim or cos.dtype != torch.float32 \
                or self.sinks.dtype != torch.float32 or cache_position.numel() != 1 \
                or not all(t.is_contiguous() for t in tensors):
            return None
        return sink_attention_step(q, k, v, self.n_heads, self.n_kv, cos, sin, k_cache, v_cache,
                                   int(cache_position), mask, self.sinks, self.scaling)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """q [B, h, T, D], k/v [B, kv, L, D], mask bool [B, 1, T, L], sinks [h] -> [B, h, T, D].

    softmax over the keys and the head's sink logit (max subtracted first), the sink's share dropped.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
