"""One row of a CPU slotted KV cache (:class:`~moeflow.engine.kv_slots.SlotKVCache`) as a batch-1 static cache:
what the serving engine runs a one-sequence pass on, so the CPU's native attention and its one-call decode step
(:mod:`moeflow.engine.cpu_layers`, which read a cache's ``layer_kv``) write and read the row in place, as they do
generate()'s cache."""

from __future__ import annotations

from typing import Protocol

import torch

from moeflow.engine.kv_cache import PassCache, attention_mask


class SlottedTensors(Protocol):
    """What a row is taken from (:class:`~moeflow.engine.kv_slots.SlotKVCache`, which imports this module): keys and
    values [layers, rows, kv_heads, max_len, D], ``valid`` bool [rows, max_len]."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    max_len: int


class SlotRow(PassCache):
    """Row ``row`` of a CPU :class:`SlotKVCache` as a batch-1 :class:`~moeflow.engine.kv_cache.StaticKVCache`: the
    same calls with the same meaning (cache_position int64 [T]: where the pass's tokens go, every one real), on
    views of the row: ``layer_kv`` each layer's k/v [1, kv_heads, max_len, D] (contiguous: what the CPU's native
    attention and one-call step write in place), ``valid`` bool [1, max_len]. A pass over one sequence on it is a
    ``generate()`` pass of batch 1 over a cache of ``max_len`` positions."""

    def __init__(self, parent: SlottedTensors, row: int) -> None:
        self.parent, self.index, self.max_len = parent, row, parent.max_len
        self.valid = parent.valid[row:row + 1]
        self.layer_kv = [(parent.k[i, row:row + 1], parent.v[i, row:row + 1]) for i in range(parent.k.shape[0])]

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        """token_mask bool [1, T]: the tokens written at cache_position [T] (all real)."""
        self.valid.index_copy_(1, cache_position, token_mask)

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Boolean mask [1, 1, T, max_len], as the static cache's."""
        return attention_mask(self.valid, cache_position, sliding_window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [1, kv_heads, T, D] at cache_position [T]; return the row's k/v [1, kv_heads, max_len, D]."""
        kl, vl = self.layer_kv[layer]
        kl.index_copy_(2, cache_position, k)
        vl.index_copy_(2, cache_position, v)
        return kl, vl
