"""The serving engine's slotted cache for multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash,
DeepSeek-V3.2, GLM-5): one compressed vector per token and layer instead of full key/value heads.

A row of DeepSeek-V3 holds 576 values per token and layer where full heads would take 40,960 (128 heads x 192
keys + 128 values, padded): the server fits about 70 times more context in the same budget, and its decode
passes read the latents with the absorbed attention ``generate`` uses (:class:`~moeflow.engine.latent_cache.
LatentKVCache`). DeepSeek Sparse Attention's indexer keys ride in the same vector. Rows, validity, masks and the
capturable decode views work as in :mod:`moeflow.engine.kv_slots`; the layers reach the latents through
``update_latent`` instead of ``update``.
"""

from __future__ import annotations

import torch

from moeflow.engine.kv_slots import SlotBatch, SlotDecodeView, SlotKVCache


class LatentSlotKVCache(SlotKVCache):
    """Latent vectors [L, rows, max_len, latent_dim] plus ``valid`` bool [rows, max_len] and a free-row list."""

    def __init__(self, num_layers: int, rows: int, max_len: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.latent = torch.zeros((num_layers, rows, max_len, latent_dim), dtype=dtype, device=device)
        self._init_rows(rows, max_len, dtype, device, None)

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()

    def _copy_keys(self, source: int, row: int, length: int) -> None:
        self.latent[:, row, :length] = self.latent[:, source, :length]


class LatentSlotBatch(SlotBatch):
    """One pass over some rows of a :class:`LatentSlotKVCache` (see :class:`SlotBatch`)."""

    def update(self, layer, k, v, cache_position):
        raise TypeError("a latent slotted cache holds one latent vector per token: layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Write the real tokens of latent [B, T, D]; return the pass's latents [B, key_len, D]."""
        cache = self.parent.latent[layer]
        cache[self._write_rows, self._write_pos] = latent[self._b, self._t]
        return cache[self._read_rows, : self.key_len]


class LatentSlotDecodeView(SlotDecodeView):
    """Capturable one-token passes over a :class:`LatentSlotKVCache` (see :class:`SlotDecodeView`)."""

    def update(self, layer, k, v, cache_position):
        raise TypeError("a latent slotted cache holds one latent vector per token: layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Write latent [batch, 1, D] at cache_position [batch, 1] (each row its source token's); return the rows'
        latents [batch, key_len, D]."""
        cache = self.parent.latent[layer]
        cache[self.rows[:, None], cache_position] = latent.index_select(0, self.source)
        return cache[:, : self.key_len].index_select(0, self.rows)


LatentSlotKVCache.batch_type, LatentSlotKVCache.view_type = LatentSlotBatch, LatentSlotDecodeView
