"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2) and the rotary embeddings it uses (YaRN, interleaved).

Per token the layer keeps one compressed vector: ``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and
the rotated rotary key ``k_rope`` (``qk_rope_head_dim`` values, shared by every head). Keys and values of
head h are ``kv_b_proj``'s slices applied to ``c`` (``k_nope = W_uk[h] c``, ``v = W_uv[h] c``) plus ``k_rope``.

Two ways to attend over that (both exact; the tests check they agree):

* expanded (prefill, and the full-head cache): multiply the latents out into per-head keys and values and
  run ordinary attention;
* absorbed (decode from the latent cache): fold ``W_uk`` into the query (``q_nope W_uk`` has ``kv_lora_rank``
  values per head) and ``W_uv`` into the output, so the step reads only the latent cache:
  ``score = (q_nope W_uk) . c + q_rope . k_rope``, ``out_h = W_uv[h] (sum_s p_s c_s)``.

The cache the engine hands in decides: one with ``update_latent`` (``LatentKVCache``: ``kv_lora_rank +
qk_rope_head_dim`` values per token per layer) or the engine's full-head ``StaticKVCache`` (keys and values
zero-padded to one head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.layers import LinearFactory, RMSNorm, rotate_half


@dataclass(frozen=True)
class MLAShape:
    """The sizes of one multi-head latent attention layer (config.json's fields)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite); else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout)
    rms_norm_eps: float = 1e-6
    softmax_scale: float = 0.0  # 0: qk_head_dim ** -0.5 (YaRN multiplies it by mscale ** 2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the latent cache keeps per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def padded_head_dim(self) -> int:
        """Head size of the full-head cache (keys and values padded to one size)."""
        return max(self.qk_head_dim, self.v_head_dim)

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim ** -0.5


# ------------------------------------------------------------------ rotary embeddings
def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float = 32,
                  beta_slow: float = 1, truncate: bool = True) -> torch.Tensor:
    """YaRN's per-pair inverse frequencies fp32 [dim // 2]: high frequencies kept (extrapolated), low ones
    divided by ``factor`` (interpolated), a linear ramp between the pairs that turn ``beta_fast`` and
    ``beta_slow`` times over the original context."""
    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns ``turns`` times
        return dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * base)) * ramp + (1.0 / base) * (1 - ramp)


class ScaledRotaryEmbedding(nn.Module):
    """Rotary cos/sin like :class:`~moeflow.families.layers.RotaryEmbedding` from given inverse frequencies,
    multiplied by ``attention_factor`` (YaRN's magnitude correction)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin) [B, T, dim], computed in fp32."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotary_from_config(rope: dict[str, Any], dim: int, theta: float, max_position: int, source: str
                       ) -> tuple[ScaledRotaryEmbedding, float]:
    """(rotary module, softmax-scale multiplier) for config.json's ``rope_scaling`` / ``rope_parameters``:
    the default rotary or YaRN (DeepSeek-V3: ``factor``, ``mscale``, ``mscale_all_dim``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if kind == "default":
        return ScaledRotaryEmbedding(1.0 / base), 1.0
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope type {kind!r} is not supported (default or yarn)")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise CheckpointError(f"{source}: yarn rope_scaling needs original_max_position_embeddings")
    factor = rope.get("factor") or max_position / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    inv_freq = yarn_inv_freq(dim, theta, factor, original, rope.get("beta_fast") or 32, rope.get("beta_slow") or 1,
                             rope.get("truncate", True))
    # DeepSeek scales the softmax by mscale(factor, mscale_all_dim) ** 2 on top of 1/sqrt(d)
    softmax_mult = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return ScaledRotaryEmbedding(inv_freq, float(attention_factor)), softmax_mult


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on interleaved pairs (x0, x1), (x2, x3), ...: x [B, heads, T, D]; cos/sin [B, T, D].

    The result lists the rotated even members, then the odd ones; queries and keys get the same layout,
    so their dot products are those of the interleaved rotation."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


def apply_rotary_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on halves (x_i, x_{i + D/2}): x [B, heads, T, D]; cos/sin [B, T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# ------------------------------------------------------------------ the attention layer
class LatentAttention(nn.Module):
    """Multi-head latent attention; parameters named as in DeepSeek checkpoints (``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).

    ``kv_b_proj`` is an ordinary dense linear (its weight is read to absorb it); the others come from
    ``linear_factory``."""

    def __init__(self, shape: MLAShape, layer_idx: int, linear_factory: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.shape, self.layer_idx = shape, layer_idx
        s, h = shape, shape.hidden_size
        if s.q_lora_rank is None:
            self.q_proj = linear_factory("q_proj", h, s.num_heads * s.qk_head_dim)
        else:
            self.q_a_proj = linear_factory("q_a_proj", h, s.q_lora_rank)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps, dtype)
            self.q_b_proj = linear_factory("q_b_proj", s.q_lora_rank, s.num_heads * s.qk_head_dim)
        self.kv_a_proj_with_mqa = linear_factory("kv_a_proj_with_mqa", h, s.latent_dim)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps, dtype)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), bias=False,
                                   dtype=dtype)
        self.o_proj = linear_factory("o_proj", s.num_heads * s.v_head_dim, h)
        self.rotate = apply_rotary_pairs if s.rope_interleave else apply_rotary_halves

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; cos/sin [B, T, qk_rope_head_dim]; mask bool [B, 1, T, max_len] -> [B, T, H]."""
        s = self.shape
        q_nope, q_rope, latent = self.project(x, self.q_input(x), cos, sin)
        if self.in_place(cache, q_nope):
            cache.write_latent(self.layer_idx, latent, cache_position)
            out = self.absorbed_in_place(cache, q_nope, q_rope, cache_position)
        elif hasattr(cache, "update_latent"):
            out = self.attend_latents(q_nope, q_rope, cache.update_latent(self.layer_idx, latent, cache_position),
                                      mask)
        else:
            k, v = self.expand(*latent.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1))
            k_all, v_all = cache.update(self.layer_idx, pad_last(k, s.padded_head_dim),
                                        pad_last(v, s.padded_head_dim), cache_position)
            out = self.attend(q_nope, q_rope, k_all[..., :s.qk_head_dim], v_all[..., :s.v_head_dim], mask)
        return self.output(out)

    def q_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the query up-projection reads: the normed q-LoRA latent [B, T, q_lora_rank] (x itself without one)."""
        return x if self.shape.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))

    def project(self, x: torch.Tensor, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H], q_in (:meth:`q_input`) -> q_nope, rotated q_rope [B, heads, T, *] and the tokens' cache
        entries [B, T, latent_dim]: ``c`` after ``kv_a_layernorm``, then the rotated ``k_rope``."""
        s = self.shape
        b, t, _ = x.shape
        q = (self.q_proj if s.q_lora_rank is None else self.q_b_proj)(q_in)
        q = q.view(b, t, s.num_heads, s.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_rope = self.rotate(q_rope, cos, sin)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        k_rope = self.rotate(k_rope[:, None], cos, sin)[:, 0]  # [B, T, rope]: one rotary key for all heads
        return q_nope, q_rope, torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1)

    def attend_latents(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Attention over cached latents [B, S, >= latent_dim] (columns past ``latent_dim`` ignored): absorbed
        for one query, expanded for more. q_* [B, heads, T, *]; mask bool [B, 1, T, S] -> [B, heads, T, v]."""
        s = self.shape
        if q_nope.shape[2] == 1:
            return self.absorbed(q_nope, q_rope, latents[..., :s.latent_dim], mask)
        k_all, v_all = self.expand(latents[..., :s.kv_lora_rank], latents[..., s.kv_lora_rank:s.latent_dim])
        return self.attend(q_nope, q_rope, k_all, v_all, mask)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, heads, T, v_head_dim] -> o_proj's [B, T, H]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.shape.num_heads * self.shape.v_head_dim))

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [B, S, kv_lora_rank], k_rope [B, S, rope] -> keys [B, heads, S, qk_head_dim], values
        [B, heads, S, v_head_dim]."""
        s = self.shape
        b, n, _ = c.shape
        kv = self.kv_b_proj(c).view(b, n, s.num_heads, s.qk_nope_head_dim + s.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(b, s.num_heads, n, s.qk_rope_head_dim)), dim=-1)
        return k, v

    def attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Ordinary attention over expanded heads: q_* [B, heads, T, *], k/v [B, heads, S, *] -> [B, heads, T, v]."""
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.shape.scale)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Attention read straight from the latents [B, S, kv_lora_rank + rope] with ``kv_b_proj`` folded into
        the query and the output: q_* [B, heads, T, *] -> [B, heads, T, v_head_dim]. The fp32-softmax torch
        reference of the server's in-place kernel (:meth:`absorbed_in_place`)."""
        s = self.shape
        query = self.absorb_query(q_nope, q_rope)  # [B, heads, T, R + rope]
        scores = torch.matmul(query, latents[:, None].transpose(-1, -2)).float() * s.scale  # [B, heads, T, S]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(latents.dtype)
        context = torch.matmul(probs, latents[:, None, :, :s.kv_lora_rank])  # [B, heads, T, R]
        return self.absorb_output(context)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s W_uk [heads, nope, R] and W_uv [heads, v, R]."""
        s = self.shape
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, :s.qk_nope_head_dim], w[:, s.qk_nope_head_dim:]

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """q_nope, q_rope [B, heads, T, *] -> the absorbed query [B, heads, T, R + rope]: ``[q_nope W_uk | q_rope]``."""
        return torch.cat((torch.einsum("bhtd,hdr->bhtr", q_nope, self.absorbed_weights()[0]), q_rope), dim=-1)

    def absorb_output(self, context: torch.Tensor) -> torch.Tensor:
        """The heads' latent contexts [B, heads, T, R] -> their outputs [B, heads, T, v_head_dim] (W_uv)."""
        return torch.einsum("bhtr,hvr->bhtv", context, self.absorbed_weights()[1])

    @staticmethod
    def in_place(cache: Any, q_nope: torch.Tensor) -> bool:
        """Whether ``cache`` reads its latents in place for this query (the server's decode view where
        ``MOEFLOW_SLOT_ATTENTION`` puts the kernel: CUDA by default); else the layer gathers them."""
        takes = getattr(cache, "latent_in_place", None)
        return takes is not None and takes(q_nope)

    def absorbed_in_place(self, cache: Any, q_nope: torch.Tensor, q_rope: torch.Tensor, cache_position: torch.Tensor,
                          select: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`absorbed` for one query token over ``cache``'s rows read in place (the tokens' latents already
        written; its mask the cache's own, ANDed with select bool [B, 1, 1, S] (DSA) when given): q_*
        [B, heads, 1, *] -> [B, heads, 1, v_head_dim]."""
        s = self.shape
        context = cache.attend_latent(self.layer_idx, self.absorb_query(q_nope, q_rope), cache_position,
                                      s.kv_lora_rank, s.scale, None if select is None else select[:, 0, 0])
        return self.absorb_output(context)


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dimension of x to ``size`` (zeros change no dot product and no weighted sum)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))
