"""A row-slotted KV cache for continuous batching: each sequence owns one row and sits at its own position.

Row-slotted rather than paged: a row reserves ``max_len`` positions for one sequence, so a request fits
when a row is free and its prompt plus ``max_tokens`` fit in ``max_len``; the number of rows comes from a
byte budget. Requests that find no free row wait in the engine's queue.

The decoder reaches a cache only through ``mark_valid``, ``attention_mask`` and ``update`` (see
``moeflow/families/layers.py``); :class:`SlotBatch` implements them for one pass over some rows, with a
position per token (``cache_position [B, T]``) instead of one shared column range. :class:`SlotDecodeView`
implements them for the engine's captured decode passes (CUDA graphs): the same reads and writes with no host
read and no shape that depends on values, over persistent row tensors the graphs bake in. A CPU pass of one
sequence runs on its row as a batch-1 static cache instead (:meth:`SlotKVCache.row`: a
:class:`~moeflow.engine.kv_cache.StaticKVCache` over the row's views).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

import torch

from moeflow.engine.kv_cache import PassCache, StaticKVCache
from moeflow.engine.linear_state import LinearState
from moeflow.errors import InputError
from moeflow.families.base import KVCacheSpec, LinearStateSpec
from moeflow.kernels.dispatch import uses_triton


def kv_bytes_per_row(num_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys plus values one sequence of ``max_len`` positions needs."""
    return 2 * num_layers * kv_heads * max_len * head_dim * torch.tensor([], dtype=dtype).element_size()


def slot_attention_mask(cache_position: torch.Tensor, valid: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [B, 1, T, key_len] from each token's position (cache_position int64 [B, T]) and its row's valid
    keys (valid bool [B, 1, key_len]): causal, sliding-window when configured, and a query always sees its own key
    (so a padding query's row is never empty)."""
    keys = torch.arange(valid.shape[-1], device=cache_position.device)
    q = cache_position[:, :, None]  # [B, T, 1]
    allowed = (keys <= q) & valid
    if sliding_window is not None:
        allowed = allowed & (q - keys < sliding_window)
    return (allowed | (keys == q))[:, None]


def cache_spec(model) -> KVCacheSpec:
    """The cache ``model``'s family asks for (full heads, latent vectors, linear states), or full heads of the
    config's sizes for a model without a family."""
    family = getattr(model, "family", None)
    if family is not None:
        return family.kv_cache_spec()
    cfg = model.config
    return KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)


def linear_spec(model) -> LinearStateSpec | None:
    """The linear-attention state ``model``'s family keeps per sequence (Qwen3-Next, Qwen3.5), else None."""
    return cache_spec(model).linear


def check_slotted(model, cache: SlotKVCache) -> None:
    """ValueError, naming the family, when ``model`` has linear-attention layers and ``cache`` keeps no state for
    them (build it with :meth:`SlotKVCache.for_model`)."""
    spec = linear_spec(model)
    if spec is not None and (cache.linear is None or cache.linear.spec != spec):
        raise ValueError(f"{model.family.name}: this model's linear-attention layers keep a state per sequence; "
                         "the slotted cache holds none of their shape (build it with SlotKVCache.for_model)")


def row_bytes(model, max_len: int) -> int:
    """Bytes one row of :meth:`SlotKVCache.for_model`'s cache takes for ``model``: keys and values (or latent
    vectors) of its attention layers for ``max_len`` positions, plus its linear-attention states when it has
    some."""
    spec = cache_spec(model)
    element = torch.tensor([], dtype=model.dtype).element_size()
    states = spec.linear.bytes_per_sequence(element) if spec.linear is not None else 0
    return spec.bytes_per_token(element) * max_len + states


class SlotKVCache:
    """Keys/values [L, rows, kv_heads, max_len, D] plus ``valid`` bool [rows, max_len] and a free-row list."""

    batch_type: ClassVar[type[SlotBatch]]  # the views its passes get (set below the classes)
    view_type: ClassVar[type[SlotDecodeView]]

    def __init__(self, num_layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, linear: LinearStateSpec | None = None) -> None:
        """``linear``: also keep each row's linear-attention state (``num_layers`` counts the attention layers)."""
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._init_rows(rows, max_len, dtype, device, linear)

    def _init_rows(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                   linear: LinearStateSpec | None) -> None:
        """What every slotted cache keeps besides its keys: validity, linear states, free rows, decode views."""
        if rows < 1 or max_len < 2:
            raise InputError(f"a slotted KV cache needs rows >= 1 and max_len >= 2, got rows={rows}, "
                             f"max_len={max_len}")
        self.valid = torch.zeros((rows, max_len), dtype=torch.bool, device=device)
        self.rows, self.max_len = rows, max_len
        self.linear = LinearState(linear, rows, dtype, device) if linear is not None else None
        self._free = list(range(rows - 1, -1, -1))  # pop() hands out the lowest row first
        self._views: dict[tuple[int, int], SlotDecodeView] = {}
        self._row_views: dict[int, StaticKVCache] = {}

    @classmethod
    def for_model(cls, model, max_len: int, budget_bytes: int | None = None, max_rows: int = 16) -> SlotKVCache:
        """As many rows of ``max_len`` as ``budget_bytes`` holds (at most ``max_rows``; all of them when None)."""
        cfg = model.config
        if max_len > cfg.max_position_embeddings:
            raise InputError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        per_row = row_bytes(model, max_len)
        rows = max_rows if budget_bytes is None else min(max_rows, budget_bytes // per_row)
        if rows < 1:
            raise InputError(f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds no sequence of {max_len} "
                             f"positions ({per_row / 2**20:.1f} MiB each): raise the budget or lower max_len")
        spec = cache_spec(model)
        if spec.latent_dim:  # multi-head latent attention: one compressed vector per token and layer
            return LatentSlotKVCache(spec.num_layers, rows, max_len, spec.latent_dim, model.dtype, model.device)
        # (hybrid models: keys and values of the full-attention layers only, and the linear states)
        return cls(spec.num_layers, rows, max_len, spec.kv_heads, spec.head_dim, model.dtype, model.device,
                   spec.linear)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + (self.linear.nbytes if self.linear is not None else 0)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def free_row_ids(self) -> list[int]:
        """The free rows, lowest first."""
        return self._free[::-1]

    def allocate(self, row: int | None = None, keep: int = 0) -> int | None:
        """A free row (``row``, else the lowest), or None when every row is taken. Its positions from ``keep`` on
        are cleared (no valid key there); ``keep`` > 0 keeps the keys of positions [0, keep) and the row's linear
        states, which the caller (the prefix cache) knows hold exactly those tokens; keep = 0 zeroes the states."""
        if not self._free:
            return None
        if row is None:
            row = self._free[-1]
        elif row not in self._free:
            raise ValueError(f"row {row} is not a free row of this cache")
        self._free.remove(row)
        self.valid[row, keep:] = False
        if self.linear is not None and keep == 0:  # a new sequence's linear-attention state starts at zero
            self.linear.clear(torch.tensor([row], device=self.valid.device))
        return row

    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Row ``row`` gets the keys/values and validity of ``source``'s positions [0, length) (the prefix cache:
        a shared prefix copied instead of recomputed). Refused with linear-attention states, which hold all the
        tokens a row has seen and cannot be cut back to a prefix."""
        if self.linear is not None:
            raise ValueError("a row with linear-attention states cannot take a prefix of another row")
        self._copy_keys(source, row, length)
        self.valid[row, :length] = self.valid[source, :length]

    def _copy_keys(self, source: int, row: int, length: int) -> None:
        self.k[:, row, :, :length] = self.k[:, source, :, :length]
        self.v[:, row, :, :length] = self.v[:, source, :, :length]

    def release(self, row: int) -> None:
        if row in self._free or not 0 <= row < self.rows:
            raise ValueError(f"row {row} is not an allocated row of this cache")
        self._free.append(row)
        self._free.sort(reverse=True)

    def batch(self, rows: torch.Tensor, cache_position: torch.Tensor, token_mask: torch.Tensor) -> SlotBatch:
        """The view one forward pass over ``rows`` [B] writes and reads (see :class:`SlotBatch`)."""
        return self.batch_type(self, rows, cache_position, token_mask)

    def row(self, row: int) -> StaticKVCache | None:
        """Row ``row`` as a batch-1 static cache (:meth:`StaticKVCache.over` its views, made once per row: the
        one-call step checks a cache's ``layer_kv`` once per list), or None where a pass must take :meth:`batch`
        instead: a cache off the CPU (its decode passes have their own views and kernels) or not fp32 (the CPU's
        native attention, which reads only the row's written keys, takes fp32; torch's would read the whole row), a
        latent cache or one with linear states."""
        if type(self) is not SlotKVCache or self.linear is not None or self.k.device.type != "cpu" \
                or self.k.dtype != torch.float32:
            return None
        view = self._row_views.get(row)
        if view is None:
            view = self._row_views[row] = StaticKVCache.over(self.k[:, row:row + 1], self.v[:, row:row + 1],
                                                             self.valid[row:row + 1])
        return view

    def decode_view(self, batch: int, key_len: int) -> SlotDecodeView:
        """The persistent :class:`SlotDecodeView` of one-token passes over ``batch`` rows reading ``key_len`` keys
        (made once: a graph captured on it stays valid for every later pass of that shape)."""
        view = self._views.get((batch, key_len))
        if view is None:
            view = self._views[(batch, key_len)] = self.view_type(self, batch, key_len)
        return view


class SlotBatch(PassCache):
    """One pass over some rows of a :class:`SlotKVCache`.

    rows int64 [B]; cache_position int64 [B, T]: where each token of each row goes; token_mask bool [B, T]:
    real tokens (False on the right padding of a shorter prefill chunk). Padding is never written, and a
    padding query (its position set to 0) sees only key 0, so its attention row is never empty.
    Reads cover keys [0, key_len): the furthest position in the pass, rounded up to a multiple of 64, so a
    short sequence does not attend over the whole row.
    """

    KEY_BLOCK = 64

    def __init__(self, parent: SlotKVCache, rows: torch.Tensor, cache_position: torch.Tensor,
                 token_mask: torch.Tensor) -> None:
        self.parent, self.rows = parent, rows
        self.max_len = parent.max_len
        self.token_mask = token_mask
        self.cache_position = torch.where(token_mask, cache_position, torch.zeros_like(cache_position))
        self._b, self._t = token_mask.nonzero(as_tuple=True)  # the real tokens, written in this pass
        self._write_rows = rows[self._b]
        self._write_pos = self.cache_position[self._b, self._t]
        furthest = int(self.cache_position.max()) + 1
        self.key_len = min(parent.max_len, -(-furthest // self.KEY_BLOCK) * self.KEY_BLOCK)
        # consecutive rows (the engine sorts a pass by row) are read as a view instead of gathered
        lo = int(rows[0])
        contiguous = bool((rows == torch.arange(lo, lo + len(rows), device=rows.device)).all())
        self._read_rows = slice(lo, lo + len(rows)) if contiguous else rows

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        self.parent.valid[self._write_rows, self._write_pos] = True

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv [B, K-1, C], recurrent fp32 [B, Hv, dk, dv], token mask [B, T]) of these rows: a prefill chunk
        goes on from the state the row's previous chunk left (its right padding leaves the state as it is)."""
        state = self.parent.linear
        return state.conv[layer][self._read_rows], state.recurrent[layer][self._read_rows], self.token_mask

    def write_linear_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        state = self.parent.linear
        state.conv[layer].index_copy_(0, self.rows, conv.to(state.conv.dtype))
        state.recurrent[layer].index_copy_(0, self.rows, recurrent)

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Boolean mask [B, 1, T, key_len]: causal per row, padding-aware, sliding-window when configured."""
        valid = self.parent.valid[self._read_rows][:, None, : self.key_len]  # [B, 1, key_len]
        return slot_attention_mask(self.cache_position, valid, sliding_window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the real tokens of k/v [B, kv_heads, T, D]; return the pass's keys/values [B, kv_heads, key_len, D]."""
        kl, vl = self.parent.k[layer], self.parent.v[layer]
        kl[self._write_rows, :, self._write_pos] = k.transpose(1, 2)[self._b, self._t]
        vl[self._write_rows, :, self._write_pos] = v.transpose(1, 2)[self._b, self._t]
        return kl[self._read_rows, :, : self.key_len], vl[self._read_rows, :, : self.key_len]


class SlotDecodeView(PassCache):
    """One-token passes over ``batch`` rows of a :class:`SlotKVCache`, reading keys [0, key_len): capturable.

    ``rows`` int64 [batch] and ``source`` int64 [batch] are persistent tensors (a captured step bakes their
    addresses in) that :meth:`load` refills before each pass. Token i is written to row ``rows[i]`` from token
    ``source[i]`` of the pass: a padding copy of token j (same row, same position) writes token j's own keys and
    values, so the duplicate writes agree whatever the copy computed. Every token of the pass is real (the engine
    pads with copies, never with masked tokens). No op reads a value back or sizes a tensor from one.
    """

    # "auto": the in-place kernels (attend, attend_latent) on CUDA only; "triton": wherever they cover the call
    # (the CPU under TRITON_INTERPRET=1: tests); "torch": never. MOEFLOW_SLOT_ATTENTION, read once.
    attention_kernel: ClassVar[str] = os.environ.get("MOEFLOW_SLOT_ATTENTION", "auto")

    def __init__(self, parent: SlotKVCache, batch: int, key_len: int) -> None:
        if not 1 <= key_len <= parent.max_len:
            raise ValueError(f"key_len={key_len} outside [1, {parent.max_len}]")
        self.parent, self.batch, self.key_len = parent, batch, key_len
        self.max_len = parent.max_len
        device = parent.valid.device
        self.rows = torch.zeros(batch, dtype=torch.long, device=device)
        self.source = torch.arange(batch, device=device)

    @property
    def graph_owner(self) -> SlotKVCache:
        """What a captured step on this view bakes in: the parent cache (moeflow.engine.cuda_graphs)."""
        return self.parent

    def load(self, rows: torch.Tensor, source: torch.Tensor) -> None:
        """rows int64 [batch]: each token's cache row; source int64 [batch]: the token whose keys it writes."""
        self.rows.copy_(rows)
        self.source.copy_(source)

    def mark_valid(self, cache_position: torch.Tensor, token_mask: torch.Tensor) -> None:
        """cache_position int64 [batch, 1]; token_mask is all True (see the class docstring)."""
        self.parent.valid.index_put_((self.rows, cache_position[:, 0]), token_mask[:, 0])
        self.token_mask = token_mask

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv, recurrent, token mask) of the pass's rows (a padding copy reads its source's row)."""
        state = self.parent.linear
        return (state.conv[layer].index_select(0, self.rows), state.recurrent[layer].index_select(0, self.rows),
                self.token_mask)

    def write_linear_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Each row gets its source token's new state: the padding copies write the same values as the token."""
        state = self.parent.linear
        state.conv[layer].index_copy_(0, self.rows, conv.index_select(0, self.source).to(state.conv.dtype))
        state.recurrent[layer].index_copy_(0, self.rows, recurrent.index_select(0, self.source))

    def snapshot(self) -> Callable[[], None]:
        """The parent's linear states copied, and the call that puts them back (see
        :meth:`moeflow.engine.linear_state.HybridKVCache.snapshot`); nothing to keep without them."""
        state = self.parent.linear
        if state is None:
            return lambda: None
        conv, recurrent = state.conv.clone(), state.recurrent.clone()

        def restore() -> None:
            state.conv.copy_(conv)
            state.recurrent.copy_(recurrent)

        return restore

    def attention_mask(self, cache_position: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Boolean mask [batch, 1, 1, key_len] (cache_position int64 [batch, 1]): as :class:`SlotBatch`'s."""
        valid = self.parent.valid[:, : self.key_len].index_select(0, self.rows)[:, None]  # [B, 1, key_len]
        return slot_attention_mask(cache_position, valid, sliding_window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [batch, kv_heads, 1, D] at cache_position [batch, 1]; return the rows' keys/values
        [batch, kv_heads, key_len, D] (a gather: :meth:`attend` reads them in place instead)."""
        kl, vl = self._write(layer, k, v, cache_position)
        return (kl[:, :, : self.key_len].index_select(0, self.rows),
                vl[:, :, : self.key_len].index_select(0, self.rows))

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row gets its source token's k/v [batch, kv_heads, 1, D]; returns the layer's K/V
        [rows, kv_heads, max_len, D]."""
        kl, vl = self.parent.k[layer], self.parent.v[layer]
        r, p = self.rows[:, None], cache_position  # [B, 1] each: advanced indices first -> [B, 1, kv_heads, D]
        kl[r, :, p] = k.index_select(0, self.source).transpose(1, 2)
        vl[r, :, p] = v.index_select(0, self.source).transpose(1, 2)
        return kl, vl

    def kernel_on(self, device: torch.device) -> bool:
        """Whether ``attention_kernel`` puts the in-place kernels on ``device`` (never while torch.compile traces)."""
        return uses_triton(self.attention_kernel, device) and not torch.compiler.is_compiling()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor,
               sliding_window: int | None, sinks: torch.Tensor | None = None, scale: float | None = None
               ) -> torch.Tensor | None:
        """Decode attention reading the rows' keys in place: q [batch, heads, 1, D], k/v [batch, kv_heads, 1, D]
        written as :meth:`update` writes them, cache_position int64 [batch, 1], sinks [heads] (gpt-oss), scale
        (default D^-0.5) -> out [batch, heads, 1, D] in q's dtype (moeflow.kernels.attention.slot).

        None, with nothing written, where the kernel does not take the call (the CPU by default, a case it does
        not cover, torch.compile tracing): the layer then runs ``update`` + its mask + its attention, today's
        path, bit for bit."""
        if not self.kernel_on(q.device):
            return None
        from moeflow.kernels.attention import slot as kernel  # imports triton: only where it runs

        if not kernel.covers(q, self.parent.k[layer]):
            return None
        kl, vl = self._write(layer, k, v, cache_position)
        return kernel.slot_attention(q, kl, vl, self.rows, self.parent.valid, cache_position, self.key_len,
                                     sliding_window, sinks, scale)


SlotKVCache.batch_type, SlotKVCache.view_type = SlotBatch, SlotDecodeView  # a latent cache has its own


# ------------------------------------------------------------------ multi-head latent attention rows
# DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5: a row of DeepSeek-V3 holds 576 values per token and
# layer where full heads would take 40,960 (128 heads x 192 keys + 128 values, padded), so the server fits about 70
# times more context in the same budget; decode passes read the latents with the absorbed attention generate uses
# (moeflow.engine.latent_cache). DeepSeek Sparse Attention's indexer keys ride in the same vector. The layers reach
# the latents through ``update_latent`` instead of ``update``.


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

    def attend(self, layer, q, k, v, cache_position, sliding_window, sinks=None, scale=None) -> None:
        """None: a latent row holds no heads to attend to in place (layers call ``update_latent``)."""
        return None

    def update(self, layer, k, v, cache_position):
        raise TypeError("a latent slotted cache holds one latent vector per token: layers call update_latent")

    def update_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Write latent [batch, 1, D] at cache_position [batch, 1] (each row its source token's); return the rows'
        latents [batch, key_len, D] (a gather: :meth:`attend_latent` reads them in place instead)."""
        self.write_latent(layer, latent, cache_position)
        return self.parent.latent[layer][:, : self.key_len].index_select(0, self.rows)

    def write_latent(self, layer: int, latent: torch.Tensor, cache_position: torch.Tensor) -> None:
        """Write latent [batch, 1, D] at cache_position [batch, 1], each row its source token's."""
        self.parent.latent[layer][self.rows[:, None], cache_position] = latent.index_select(0, self.source)

    def latent_in_place(self, q: torch.Tensor) -> bool:
        """Whether :meth:`attend_latent` takes queries like q [batch, heads, 1, *] (their dtype and device; the
        CPU by default, torch.compile tracing and other dtypes than the cache's keep the gather)."""
        latent = self.parent.latent
        return (self.kernel_on(q.device) and q.shape[2] == 1 and q.dtype == latent.dtype
                and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.device == latent.device)

    def latent_columns(self, layer: int, lo: int) -> torch.Tensor:
        """The rows' latent columns [lo, latent_dim) [batch, key_len, latent_dim - lo] (DSA's indexer keys)."""
        return self.parent.latent[layer][:, : self.key_len, lo:].index_select(0, self.rows)

    def attend_latent(self, layer: int, query: torch.Tensor, cache_position: torch.Tensor, kv_rank: int,
                      scale: float, select: torch.Tensor | None = None) -> torch.Tensor:
        """MLA's absorbed decode attention reading the rows' latents in place (written first, with
        :meth:`write_latent`): query [batch, heads, 1, kv_rank + rope], cache_position int64 [batch, 1], select
        bool [batch, key_len] (DSA) -> context [batch, heads, 1, kv_rank] in the query's dtype
        (moeflow.kernels.attention.latent). Only where :meth:`latent_in_place` said so."""
        from moeflow.kernels.attention.latent import latent_attention  # imports triton: only where it runs

        return latent_attention(query, self.parent.latent[layer], self.rows, self.parent.valid, cache_position,
                                self.key_len, kv_rank, scale, select)


LatentSlotKVCache.batch_type, LatentSlotKVCache.view_type = LatentSlotBatch, LatentSlotDecodeView
