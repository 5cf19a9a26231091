"""The capturable view of prompt lookup's verify pass in the serving engine, and the key-length buckets the
engine's captured passes read (:func:`key_bucket`).

A drafted pass (:mod:`moeflow.engine.continuous_lookup`) feeds one row 1 + c tokens: its last token and c drafted
ones. Captured (CUDA graphs), it has one shape, ``width`` = 1 + N tokens: a shorter draft is followed by *fillers*
at the next positions (clamped into the row), whose keys are written there but never marked valid: the positions
past a row's fed tokens hold no valid key, so no later query reads them, and the next real token at a position
overwrites its key. A :class:`SlotVerifyView` runs such a pass over persistent tensors (the row, which tokens are
real) that a captured step bakes in, with no host read and no shape that depends on values, as
:class:`~moeflow.engine.kv_slots.SlotDecodeView` does for one-token passes.
"""

from __future__ import annotations

import torch

from moeflow.engine.kv_cache import PassCache
from moeflow.engine.kv_slots import LatentSlotKVCache, SlotKVCache, slot_attention_mask

MIN_KEY_BUCKET = 256  # keys a captured decode pass reads at least (see key_bucket)


def key_bucket(needed: int, max_len: int) -> int:
    """Keys a captured decode pass reads for ``needed`` (its furthest position + 1): the next power of two, at
    least MIN_KEY_BUCKET, at most ``max_len``; few buckets, so few captures, and a short context does not attend
    over the whole row."""
    return min(max_len, max(MIN_KEY_BUCKET, 1 << max(0, needed - 1).bit_length()))


class SlotVerifyView(PassCache):
    """Passes of ``width`` tokens over one row of a :class:`~moeflow.engine.kv_slots.SlotKVCache`, reading keys
    [0, key_len): capturable.

    ``rows`` int64 [1] and ``real`` bool [1, width] are persistent (a captured step bakes their addresses in);
    :meth:`load` refills them before each pass. Every token's keys are written at its position; only the real
    ones become valid (the view's own ``real``, whatever token mask the expert backend is given: a backend traced
    into the graph computes the fillers as real tokens). Attention is causal by position over the row's valid
    keys, as :class:`~moeflow.engine.kv_slots.SlotBatch`'s.
    """

    def __init__(self, parent: SlotKVCache, width: int, key_len: int) -> None:
        if not 1 <= key_len <= parent.max_len:
            raise ValueError(f"key_len={key_len} outside [1, {parent.max_len}]")
        self.parent, self.width, self.key_len = parent, width, key_len
        self.max_len = parent.max_len
        device = parent.valid.device
        self.rows = torch.zeros(1, dtype=torch.long, device=device)
        self.real = torch.zeros((1, width), dtype=torch.bool, device=device)

    @property
    def graph_owner(self) -> SlotKVCache:
        """What a captured step on this view bakes in: the parent cache (moeflow.engine.cuda_graphs)."""
        return self.parent

    def load(self, row: torch.Tensor, real: torch.Tensor) -> None:
        """row int64 [1]: the cache row; real bool [1, width]: the tokens whose keys become valid."""
        self.rows.copy_(row)
        self.real.copy_(real)

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        """cache_position int64 [1, width]: the real tokens' positions become valid, the fillers' stay as they were
        (a filler may share the last position with others: they all write the same value)."""
        index = (self.rows[:, None].expand_as(cache_position), cache_position)
        valid = self.parent.valid
        valid.index_put_(index, valid[index] | self.real)

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Boolean mask [1, 1, width, key_len] (cache_position int64 [1, width]): as SlotBatch's."""
        valid = self.parent.valid[:, : self.key_len].index_select(0, self.rows)[:, None]  # [1, 1, key_len]
        return slot_attention_mask(cache_position, valid, sliding_window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [1, kv_heads, width, D] at cache_position [1, width]; return the row's keys/values
        [1, kv_heads, key_len, D]."""
        kl, vl = self.parent.k[layer], self.parent.v[layer]
        r = self.rows[:, None]  # [1, 1]: advanced indices first -> [1, width, kv_heads, D]
        kl[r, :, cache_position] = k.transpose(1, 2)
        vl[r, :, cache_position] = v.transpose(1, 2)
        return (kl[:, :, : self.key_len].index_select(0, self.rows),
                vl[:, :, : self.key_len].index_select(0, self.rows))


class LatentSlotVerifyView(SlotVerifyView):
    """Capturable verify passes over one row of a :class:`~moeflow.engine.kv_slots.LatentSlotKVCache`."""

    def update(self, layer, k, v, cache_position):
        raise TypeError("a latent slotted cache holds one latent vector per token: layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Write latent [1, width, D] at cache_position [1, width]; return the row's latents [1, key_len, D]."""
        cache = self.parent.latent[layer]
        cache[self.rows[:, None], cache_position] = latent
        return cache[:, : self.key_len].index_select(0, self.rows)


def verify_view(cache: SlotKVCache, width: int, key_len: int) -> SlotVerifyView:
    """A new verify view of ``cache`` (its latent form for a latent cache)."""
    kind = LatentSlotVerifyView if isinstance(cache, LatentSlotKVCache) else SlotVerifyView
    return kind(cache, width, key_len)
