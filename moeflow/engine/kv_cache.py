"""A static key/value cache: allocated once per generate() call, written at explicit positions.

Static shapes (the whole cache is attended to, with a mask) let torch.compile trace a decode step
once and replay it for every token, as gpt-fast does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeflow.compile_boundary import eager_host_step


def _nothing_to_restore() -> None:
    return None


class PassCache:
    """The base of every cache a forward pass runs on (:class:`StaticKVCache` and its kinds, :class:`CacheRows`, the
    slotted cache's passes in :mod:`moeflow.engine.kv_slots`): what the engine's step machinery asks of it besides
    the attention layers' calls (``update`` or ``update_latent``, ``mark_valid``, ``attention_mask``), with the
    answers of a cache that offers none of it.

    graph_owner: what a decode step captured on this cache bakes in (:mod:`moeflow.engine.cuda_graphs`); None: not
    capturable (a view made anew every pass). layer_kv: each layer's k/v [B, kv_heads, max_len, D] as views made
    once, which the CPU step's one-call attention writes in place (:mod:`moeflow.engine.cpu_step`); None: none.
    """

    graph_owner: object | None = None
    layer_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def snapshot(self) -> Callable[[], None]:
        """A copy of the state a run of the decode step advances for good (linear-attention states), and the call
        that puts it back (the CUDA-graph capture's warm-up); nothing to keep by default."""
        return _nothing_to_restore


class StaticKVCache(PassCache):
    def __init__(
        self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # which cache positions hold a real (non-padding) token, per sequence
        self.valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
        self.max_len = max_len
        # each layer's k/v [B, kv_heads, max_len, D] as views made once (the CPU step's attention op writes them)
        self.layer_kv = [(self.k[i], self.v[i]) for i in range(num_layers)]

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> StaticKVCache:
        """A static cache over existing tensors, read and written in place: k/v [layers, B, kv_heads, max_len, D],
        valid bool [B, max_len] (a serving cache's row: :meth:`~moeflow.engine.kv_slots.SlotKVCache.row`)."""
        cache = cls.__new__(cls)  # (nothing allocated: __init__ would make zeroed tensors of its own)
        cache.k, cache.v, cache.valid, cache.max_len = k, v, valid, valid.shape[1]
        cache.layer_kv = [(k[i], v[i]) for i in range(k.shape[0])]
        return cache

    @property
    def graph_owner(self) -> StaticKVCache:
        """A captured decode step on this cache bakes in its own tensors (moeflow.engine.cuda_graphs)."""
        return self

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def clear(self) -> None:
        """Empty the cache for a new generation: no position is valid (what is stored stays, masked)."""
        self.valid.zero_()

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, kv_heads, T, D] at cache_position [T]; return the whole layer cache."""
        self.k[layer].index_copy_(2, cache_position, k)
        self.v[layer].index_copy_(2, cache_position, v)
        return self.k[layer], self.v[layer]

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        """token_mask bool [B, T]: which of the tokens written at cache_position [T] are real."""
        self.valid.index_copy_(1, cache_position, token_mask)

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Boolean mask [B, 1, T, max_len]: causal, padding-aware, sliding-window when configured."""
        return attention_mask(self.valid, cache_position, sliding_window)

    def rows(self, rows: torch.Tensor) -> CacheRows:
        """A view of the sequences ``rows`` (a micro-batch) that reads and writes this cache in place."""
        return CacheRows(self, rows)


def attention_mask(valid: torch.Tensor, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """valid bool [B, max_len], cache_position [T] -> mask [B, 1, T, max_len].

    A query may always see its own position, so rows of padding queries are never empty (no NaN). One query on
    the CPU (a decode step) takes three ops for the same booleans instead of seven.
    """
    if cache_position.numel() == 1 and eager_host_step(valid, cache_position) \
            and 0 <= (q := int(cache_position)) < valid.shape[1]:
        allowed = valid.numpy().copy()  # (numpy's slices: ~1 us each where torch's take ~5)
        allowed[:, q + 1:] = False
        if sliding_window is not None:
            allowed[:, :max(q - sliding_window + 1, 0)] = False
        allowed[:, q] = True
        return torch.from_numpy(allowed)[:, None, None]
    keys = torch.arange(valid.shape[1], device=cache_position.device)
    q = cache_position[:, None]  # [T, 1]
    allowed = (keys[None, :] <= q)[None] & valid[:, None, :]  # [B, T, max_len]
    if sliding_window is not None:
        allowed = allowed & (q - keys[None, :] < sliding_window)[None]
    allowed = allowed | (keys[None, :] == q)[None]
    return allowed[:, None]


class CacheRows(PassCache):
    """Some sequences of a :class:`StaticKVCache`, for regrouped micro-batches (ExpertFlow's merge/reindex).

    Writes go straight into the parent's rows; reads gather them, so a sequence can move between
    micro-batches from one step to the next without recomputing or moving its cache.
    """

    def __init__(self, parent: StaticKVCache, rows: torch.Tensor):
        self.parent, self.rows = parent, rows  # rows: int64 [b]
        self.max_len = parent.max_len

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [b, kv_heads, T, D] at cache_position [T] of these rows; return [b, kv_heads, max_len, D]."""
        r, p = self.rows[:, None], cache_position[None, :]
        self.parent.k[layer][r, :, p] = k.transpose(1, 2)  # advanced indices first: [b, T, kv_heads, D]
        self.parent.v[layer][r, :, p] = v.transpose(1, 2)
        return self.parent.k[layer].index_select(0, self.rows), self.parent.v[layer].index_select(0, self.rows)

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        self.parent.valid[self.rows[:, None], cache_position[None, :]] = token_mask

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        return attention_mask(self.parent.valid.index_select(0, self.rows), cache_position, sliding_window)
