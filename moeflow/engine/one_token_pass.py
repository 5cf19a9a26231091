"""What a pass must look like for a one-call native decode step (:mod:`moeflow.engine.cpu_layers`,
:mod:`moeflow.engine.cpu_layers_gpt_oss`): one real token in fp32, no routing recorder, each layer's KV cache a
contiguous fp32 [1, n_kv, L, D] of one shape, masks bool [1, 1, 1, L], cos / sin contiguous fp32 [.., D], one int64
cache position. Each check returns None (the caller runs the layers one by one) rather than raising. And the tail
both steps run after their last layer (:class:`TailHead`: the final norm and the lm_head in the same call)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moeflow.families.layers import RMSNorm
from moeflow.kernels.cpu.layers import HeadDesc, head_desc, head_ok
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import RoutingRecorder


def one_real_token(x: torch.Tensor, routing: RoutingRecorder | None, experts: ExpertBackend) -> bool:
    """x [B, T, H]: whether the pass is one fp32 token, not recorded, with no padding marked on the backend."""
    if routing is not None or x.shape[:2] != (1, 1) or x.dtype != torch.float32:
        return False
    real = experts._real_tokens
    return real is None or real[0] is None


def layer_caches(layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 layer_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The (k, v) caches of the layers ``layer_ids`` from a cache's ``layer_kv`` when every one is a contiguous fp32
    [1, n_kv, L, D] and all have one shape, else None."""
    kv = [layer_kv[i] for i in layer_ids]
    if any(k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()) or k.shape[0] != 1
           or v.shape != k.shape for k, v in kv) or len({k.shape for k, _ in kv}) != 1:
        return None
    return kv


class LayerCaches:
    """:func:`layer_caches` for one step's layers, checked once per cache: a cache's ``layer_kv`` is a list of views
    made once with the cache (engine/kv_cache.py), so the same list holds the same tensors. A refusal is not kept
    (checked again on the next pass)."""

    def __init__(self) -> None:
        self._seen: tuple[list, list] | None = None  # (a cache's layer_kv, its layers' (k, v) checked)

    def __call__(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 layer_ids: Callable[[], list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The layers' (k, v) caches (``layer_ids()``: their indices, read only when ``layer_kv`` is new), or None."""
        if self._seen is not None and self._seen[0] is layer_kv:
            return self._seen[1]
        kv = layer_caches(layer_kv, layer_ids())
        if kv is not None:
            self._seen = (layer_kv, kv)
        return kv


def pass_caches(kv: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, cache_position: torch.Tensor) -> list[tuple[torch.Tensor, ...]] | None:
    """Each layer's (k cache, v cache, mask) when the masks (bool [1, 1, 1, L], contiguous), the rotary cos / sin
    (contiguous fp32, D values) and ``cache_position`` (int64, one) are what the native step reads, else None.
    ``kv``: :func:`layer_caches`' list."""
    length, checked = kv[0][0].shape[2], set()
    for mask in masks:  # (layers share one mask per window: each checked once)
        if id(mask) not in checked:
            if mask.dtype != torch.bool or not mask.is_contiguous() or mask.numel() != length:
                return None
            checked.add(id(mask))
    if cache_position.dtype != torch.int64 or cache_position.numel() != 1 \
            or not (cos.is_contiguous() and sin.is_contiguous()) or cos.dtype != torch.float32 \
            or cos.numel() != kv[0][0].shape[3]:
        return None
    return [(k, v, mask) for (k, v), mask in zip(kv, masks, strict=True)]


class TailHead:
    """The tail's descriptor (:func:`~moeflow.kernels.cpu.layers.head_desc`) for a decoder's final norm and lm_head,
    built once and kept while the norm, the head and their tensors' addresses stay the same. ``norm_type``: the
    decoder's final norm class (an :class:`~moeflow.families.layers.RMSNorm` whose ``native`` call the tail's
    mf_rmsnorm is)."""

    def __init__(self, norm_type: type[RMSNorm]) -> None:
        self.norm_type = norm_type
        self._head: tuple[tuple, HeadDesc] | None = None  # (what it was built from, the descriptor)

    def desc(self, norm: nn.Module, lm_head: nn.Module) -> HeadDesc | None:
        """The descriptor, or None (the decoder runs its norm and head in Python) when ``norm`` is not the native
        ``norm_type``, a hook is on either, or :func:`~moeflow.kernels.cpu.layers.head_ok` refuses the head."""
        if type(norm) is not self.norm_type or not norm.native or any(m._forward_hooks or m._forward_pre_hooks
                                                                       for m in (norm, lm_head)):
            return None
        tensors = (norm._parameters.get("weight"), *lm_head._buffers.values(),  # (a refined head's: its two)
                   *(t for m in lm_head._modules.values() if m is not None for t in m._buffers.values()))
        key = (norm, lm_head, norm.eps, *(None if t is None else t.data_ptr() for t in tensors))
        if self._head is None or self._head[0] != key:
            if not head_ok(norm.weight, lm_head):
                return None
            self._head = (key, head_desc(norm.weight, norm.eps, lm_head))
        return self._head[1]
