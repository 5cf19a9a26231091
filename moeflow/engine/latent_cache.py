"""A static cache of one compressed vector per token per layer (multi-head latent attention), and the one
place the engine turns a family's :class:`~moeflow.families.base.KVCacheSpec` into a cache.

DeepSeek's attention needs, per token, only ``kv_lora_rank + qk_rope_head_dim`` values (576 for V3) instead of
``2 x heads x head_dim`` (49,152 for V3's 128 heads): the layer reads them with ``update_latent`` and absorbs
the up-projection itself. Validity, masks and micro-batch row views work as in :class:`StaticKVCache`.
"""

from __future__ import annotations

import torch

from moeflow.engine.kv_cache import CacheRows, StaticKVCache
from moeflow.families.base import KVCacheSpec


class LatentKVCache(StaticKVCache):
    def __init__(self, num_layers: int, batch: int, max_len: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.latent = torch.zeros((num_layers, batch, max_len, latent_dim), dtype=dtype, device=device)
        self.valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()

    def update(self, layer, k, v, cache_position):
        raise TypeError("LatentKVCache holds one latent vector per token: attention layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, D] at cache_position [T]; return the layer's whole cache [B, max_len, D]."""
        self.latent[layer].index_copy_(1, cache_position, latent)
        return self.latent[layer]

    def rows(self, rows: torch.Tensor) -> LatentCacheRows:
        return LatentCacheRows(self, rows)


class LatentCacheRows(CacheRows):
    """Some sequences of a :class:`LatentKVCache` (micro-batches): writes go to the parent's rows in place."""

    def update(self, layer, k, v, cache_position):
        raise TypeError("LatentKVCache holds one latent vector per token: attention layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """latent [b, T, D] at cache_position [T] of these rows -> [b, max_len, D]."""
        self.parent.latent[layer][self.rows[:, None], cache_position[None, :]] = latent
        return self.parent.latent[layer].index_select(0, self.rows)


def new_kv_cache(spec: KVCacheSpec, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> StaticKVCache:
    """The cache a family's spec asks for: latent vectors when ``spec.latent_dim``, full k/v heads plus the
    linear-attention layers' states when ``spec.linear``, else full k/v heads."""
    if spec.linear is not None:
        from moeflow.engine.linear_state import HybridKVCache

        return HybridKVCache(spec.num_layers, batch, max_len, spec.kv_heads, spec.head_dim, spec.linear, dtype, device)
    if spec.latent_dim:
        return LatentKVCache(spec.num_layers, batch, max_len, spec.latent_dim, dtype, device)
    return StaticKVCache(spec.num_layers, batch, max_len, spec.kv_heads, spec.head_dim, dtype, device)
