"""The per-sequence state of linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5-MoE), kept beside the
KV cache of the model's full-attention layers.

A linear-attention layer keeps, per sequence, a fixed-size state instead of one entry per token: the last
``K - 1`` inputs of its causal conv (``conv [B, K-1, conv_dim]``, the model dtype) and the recurrent state
(``recurrent [B, v_heads, k_dim, v_dim]``, fp32 as transformers keeps it). :class:`LinearState` holds both for
every such layer; :class:`HybridKVCache` is the engine's cache for these models: a
:class:`~moeflow.engine.kv_cache.StaticKVCache` over the full-attention layers only, plus a ``LinearState``.

The layer reaches its state through ``cache.linear_state(i)`` -> (conv, recurrent, token mask of the pass) and
``cache.write_linear_state(i, conv, recurrent)`` (in place: a captured decode step keeps its addresses). The pass's
token mask is the one the decoder hands ``mark_valid``. ``clear()`` empties the cache for a new generation (no
valid position, zero states); :meth:`HybridKVCache.rows` gives micro-batches (ExpertFlow) a view of their rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeflow.engine.kv_cache import CacheRows, StaticKVCache
from moeflow.families.base import LinearStateSpec


class LinearState:
    """conv [L, B, K-1, conv_dim] (``dtype``) and recurrent [L, B, v_heads, k_dim, v_dim] (fp32), zero at start."""

    def __init__(self, spec: LinearStateSpec, batch: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.spec = spec
        self.conv = torch.zeros((spec.num_layers, batch, spec.conv_kernel - 1, spec.conv_dim), dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros((spec.num_layers, batch, spec.v_heads, spec.k_dim, spec.v_dim),
                                     dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def clear(self, rows: torch.Tensor | None = None) -> None:
        """Zero the states of ``rows`` [b] (every row when None): those sequences start afresh."""
        if rows is None:
            self.conv.zero_()
            self.recurrent.zero_()
        else:
            self.conv[:, rows] = 0
            self.recurrent[:, rows] = 0


class HybridKVCache(StaticKVCache):
    """Keys/values of the full-attention layers (indexed by their position among those layers) and the
    :class:`LinearState` of the linear-attention ones, for ``batch`` sequences of ``max_len`` positions."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 linear: LinearStateSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(num_layers, batch, max_len, kv_heads, head_dim, dtype, device)
        self.linear = LinearState(linear, batch, dtype, device)
        self.pass_mask = torch.ones((batch, 1), dtype=torch.bool, device=device)  # the current pass's real tokens

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.linear.nbytes

    def clear(self) -> None:
        super().clear()
        self.linear.clear()

    def snapshot(self) -> Callable[[], None]:
        """A copy of the linear states and the call that puts it back: a decode step run to warm up and capture
        CUDA graphs must not advance them (moeflow.engine.cuda_graphs.capture_step); keys and values need none
        (rewriting a position writes the same values)."""
        conv, recurrent = self.linear.conv.clone(), self.linear.recurrent.clone()

        def restore() -> None:
            self.linear.conv.copy_(conv)
            self.linear.recurrent.copy_(recurrent)

        return restore

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        super().mark_valid(cache_position, token_mask)
        self.pass_mask = token_mask

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv [B, K-1, C], recurrent fp32 [B, Hv, dk, dv], the pass's token mask bool [B, T]) of linear layer
        ``layer``."""
        return self.linear.conv[layer], self.linear.recurrent[layer], self.pass_mask

    def write_linear_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.linear.conv[layer].copy_(conv)
        self.linear.recurrent[layer].copy_(recurrent)

    def rows(self, rows: torch.Tensor) -> HybridCacheRows:
        return HybridCacheRows(self, rows)


class HybridCacheRows(CacheRows):
    """Some sequences of a :class:`HybridKVCache` (micro-batches): states are gathered and written back by row."""

    parent: HybridKVCache

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        super().mark_valid(cache_position, token_mask)
        self.pass_mask = token_mask

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.parent.linear
        return state.conv[layer].index_select(0, self.rows), state.recurrent[layer].index_select(0, self.rows), \
            self.pass_mask

    def write_linear_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        state = self.parent.linear
        state.conv[layer].index_copy_(0, self.rows, conv.to(state.conv.dtype))
        state.recurrent[layer].index_copy_(0, self.rows, recurrent)
