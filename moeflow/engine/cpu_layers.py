"""A one-token CPU decode step through every decoder layer as one native call (issue 21).

:func:`native_layers` (called by :func:`~moeflow.engine.cpu_step.fuse_cpu_step`) gives a decoder whose layers all
have the one-call attention half (:class:`~moeflow.engine.cpu_step.NativeAttentionHalf`) and an MoE block with the
native router a :class:`NativeLayers`, which the decoder runs each pass (``CausalDecoder.set_layers_step``). It
takes a pass only when the per-layer path would run exactly the native calls it makes itself
(:func:`~moeflow.kernels.cpu.layers.layers_step`): one token, fp32, the engine's static cache, the experts in a
:class:`~moeflow.moe.resident.CpuInt4Experts` backend on moeflow's kernels or GGUF experts (Q8_0, Q4_K, Q5_K,
Q6_K, Q4_K_M's mixes) resident in a CPU pool on :mod:`moeflow.kernels.cpu.gguf` (:func:`native_experts`), every
fused path switched on, no routing to record, no module hooks (a profiler's labels still see every module).
Otherwise it returns None and the layers run one by one. Same calls in the same order: the same logits, bit for
bit. gpt-oss decoders get their own one call (:mod:`moeflow.engine.cpu_layers_gpt_oss`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from moeflow.engine.cpu_layers_gpt_oss import NativeGptOssLayers, native_gpt_oss_layers
from moeflow.engine.cpu_step import NativeAttentionHalf, NativeMLP, NativeRoute, NativeRouterGate
from moeflow.engine.kv_cache import PassCache
from moeflow.engine.mapped_experts import MappedGGUFExperts
from moeflow.engine.one_token_pass import LayerCaches, TailHead, one_real_token, pass_caches
from moeflow.families import llama_moe, mixtral
from moeflow.families.base import CausalDecoder
from moeflow.families.layers import GatedMLP, RMSNorm
from moeflow.kernels.cpu.decode_loop import LoopParts
from moeflow.kernels.cpu.gguf import GGUFCpuExpert
from moeflow.kernels.cpu.layers import LayerDesc, layer_desc, layers_step
from moeflow.kernels.dispatch import uses_triton
from moeflow.kernels.formats.gguf import GGUFFormat
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import MoEBlock, RoutingRecorder
from moeflow.moe.resident import CpuInt4Experts, ResidentExperts

# the layer types whose forward is ``x, h = self.attention_half(...); x + moe_block(h)``, and their MoE block
# (llama_moe's: Qwen3-MoE and OLMoE too, their QK-norm inside the attention call, and Qwen2-MoE with its shared
# expert as a NativeMLP; a dense MLP layer keeps the decoder's layers one by one: native_layers)
LAYER_BLOCKS: dict[type[nn.Module], Callable[[Any], nn.Module]] = {
    mixtral.DecoderLayer: lambda layer: layer.block_sparse_moe, llama_moe.DecoderLayer: lambda layer: layer.mlp,
}


class NativeLayers:
    """The decoder's layers as one native call for one-token steps (module docstring). ``enabled``: switched by
    :func:`~moeflow.engine.cpu_step.set_cpu_step_fused`."""

    def __init__(self, layers: list[nn.Module], blocks: list[MoEBlock]) -> None:
        self.layers, self.blocks, self.enabled = layers, blocks, True
        halves = [layer.attention_step for layer in layers]
        self.modules = [m for layer, half, block in zip(layers, halves, blocks, strict=True) for m in
                        (layer, half.norm_in, half.attn, half.norm_post, block, block.gate,
                         *([block.shared_expert] if block.shared_expert is not None else []))]
        self._descs: tuple[Any, ctypes.Array, list] | None = None  # (backend, descriptors, their expert tables)
        self._tail = TailHead(RMSNorm)  # the final norm and lm_head's descriptor
        self._kv = LayerCaches()  # each layer's (k, v) cache, checked once per cache

    def _fused(self) -> bool:
        """Whether every layer would take its fused calls (the switches set_cpu_step_fused flips). Read per pass
        from the objects themselves (the modules' own dicts: no nn.Module attribute look-up, ~10 us for 8 layers)."""
        for layer, block in zip(self.layers, self.blocks, strict=True):
            half, parts = layer.__dict__.get("attention_step"), block._modules
            gate, shared, route = parts.get("gate"), parts.get("shared_expert"), block.__dict__.get("route")
            if not (isinstance(half, NativeAttentionHalf) and half.attn.fused_step and half.norm_in.native
                    and half.norm_post.native and isinstance(gate, NativeRouterGate) and gate.native
                    and isinstance(route, NativeRoute) and route.native
                    and (shared is None or shared.native_step.native)):
                return False
        return not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in self.modules))

    def _descriptors(self, experts: ExpertBackend) -> ctypes.Array | None:
        """The layers' descriptors for this backend (built once; None when an expert is not on the native kernels)."""
        if self._descs is not None and self._descs[0] is experts:
            return self._descs[1]
        descs, tables = [], []
        for layer, block in zip(self.layers, self.blocks, strict=True):
            forms = _layer_experts(experts, block.layer_idx)
            if forms is None:
                return None
            half = layer.attention_step
            attn = half.attn
            step = None if block.shared_expert is None else block.shared_expert.native_step
            desc, table = layer_desc(half.norm_in.weight, half.norm_post.weight, half.norm_in.eps, attn.qkv_proj,
                                     attn.o_proj, attn.n_heads, attn.n_kv, attn.head_dim, block.gate.weight,
                                     block.route.top_k, block.route.renormalize, forms, attn.native_qk_norm(),
                                     None if step is None else (step.w13, step.w2, step.gate))
            descs.append(desc)
            tables.append(table)
        array = (LayerDesc * len(descs))(*descs)
        self._descs = (experts, array, tables)
        return array

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
                 cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
                 routing: RoutingRecorder | None) -> torch.Tensor | None:
        """x fp32 [1, 1, H] after every layer, or None when this pass is not one it takes (module docstring).
        ``masks``: each layer's attention mask bool [1, 1, 1, L]."""
        taken = self._take(x, cos, sin, cache, cache_position, masks, experts, routing)
        if taken is None:
            return None
        return layers_step(taken[0], x.contiguous(), cos, sin, taken[1], cache_position)

    def logits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
               cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
               routing: RoutingRecorder | None, norm: nn.Module, lm_head: nn.Module) -> torch.Tensor | None:
        """The pass's logits fp32 [1, 1, V] = ``lm_head(norm(x after every layer))`` with the tail in the same
        native call (:func:`~moeflow.kernels.cpu.layers.layers_step` with a ``head``), or None (nothing run) when
        the pass is not one :meth:`__call__` takes, or ``norm`` / ``lm_head`` are not the native RMSNorm and an
        int8/int4 CpuQuantLinear, a GGUFLinear or a RefinedInt4LmHead (:func:`~moeflow.kernels.cpu.layers.head_ok`;
        a hook on either: the head runs in Python)."""
        head = self._tail.desc(norm, lm_head)
        if head is None:
            return None
        taken = self._take(x, cos, sin, cache, cache_position, masks, experts, routing)
        if taken is None:
            return None
        logits = torch.empty((1, 1, lm_head.out_features))
        layers_step(taken[0], x.contiguous(), cos, sin, taken[1], cache_position, head=head, logits=logits)
        return logits

    def loop_parts(self, cache: PassCache, experts: ExpertBackend, norm: nn.Module, lm_head: nn.Module
                   ) -> LoopParts | None:
        """The step's :class:`~moeflow.kernels.cpu.decode_loop.LoopParts` (the layers' descriptors, the tail's, each
        layer's (k, v) cache, the scale) for a greedy loop of one-token passes (:mod:`moeflow.engine.native_decode`)
        when :meth:`logits` would take such a pass on ``cache`` with these ``experts``, ``norm`` and ``lm_head``,
        else None: the checks of :meth:`_take` that do not depend on the pass's own tensors (those the loop makes
        itself: one fp32 token, cos / sin, masks, its position)."""
        head = self._tail.desc(norm, lm_head)
        layer_kv = cache.layer_kv
        if head is None or not self.enabled or layer_kv is None or not native_experts(experts) or not self._fused():
            return None
        kv = self._kv(layer_kv, lambda: [layer.attention_step.attn.layer_idx for layer in self.layers])
        descs = None if kv is None else self._descriptors(experts)
        return None if descs is None else LoopParts("layers", descs, head, kv, 1.0 / math.sqrt(kv[0][0].shape[3]))

    def _take(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
              cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
              routing: RoutingRecorder | None) -> tuple[ctypes.Array, list[tuple[torch.Tensor, ...]]] | None:
        """(the layers' descriptors, each layer's (k cache, v cache, mask)) when this pass is one the native call
        takes, else None (module docstring)."""
        layer_kv = cache.layer_kv
        if not self.enabled or layer_kv is None or not one_real_token(x, routing, experts) \
                or not native_experts(experts) or not self._fused():
            return None
        kv = self._kv(layer_kv, lambda: [layer.attention_step.attn.layer_idx for layer in self.layers])
        caches = None if kv is None else pass_caches(kv, masks, cos, sin, cache_position)
        if caches is None:
            return None
        descs = self._descriptors(experts)
        return None if descs is None else (descs, caches)


def _native_shared(shared: nn.Module | None) -> bool:
    """Whether the one call computes ``shared`` (a block's shared expert): none, or one with a native step."""
    return shared is None or (isinstance(shared, GatedMLP) and isinstance(shared.native_step, NativeMLP))


def native_experts(experts: ExpertBackend) -> bool:
    """Whether the per-layer path computes ``experts`` with the native expert kernels the one call makes: a
    :class:`~moeflow.moe.resident.CpuInt4Experts`, or every GGUF expert resident in a CPU pool computed by
    :mod:`moeflow.kernels.cpu.gguf` (``GGUFFormat.cpu_kernels``; the op's "cpu" backend) or over the mapped file
    (:class:`~moeflow.engine.mapped_experts.MappedGGUFExperts`)."""
    if type(experts) is CpuInt4Experts or type(experts) is MappedGGUFExperts:
        return True
    return type(experts) is ResidentExperts and isinstance(experts.fmt, GGUFFormat) and experts.fmt.cpu_kernels \
        and experts.pool.device.type == "cpu" and not uses_triton(experts.kernels_backend, experts.pool.device)


def _layer_experts(experts: ExpertBackend, layer: int) -> list | None:
    """Layer ``layer``'s experts in expert order as :func:`~moeflow.kernels.cpu.layers.layer_desc` takes them:
    q4 (w13, w2) pairs, or GGUF experts over the pool's slot bytes (the views the per-layer op computes on);
    None when one is not on the native kernels."""
    if type(experts) is CpuInt4Experts:
        forms = experts.experts[layer]
        if any(f is None or not f.native or f.w13.fmt != f.w2.fmt for f in forms):
            return None
        return [(f.w13, f.w2) for f in forms]
    if type(experts) is MappedGGUFExperts:  # the forms are views of the mapped file
        return list(experts.experts[layer])
    pool, t = experts.pool, experts.pool.tensors
    return [GGUFCpuExpert(t["gate"][s], t["up"][s], t["down"][s], *pool.fmt.region_types(pool.buffer[s]))
            for s in experts.slot_tables[layer].tolist()]


def native_layers(decoder: CausalDecoder) -> NativeLayers | NativeGptOssLayers | None:
    """The decoder's :class:`NativeLayers` when every layer is of a known layout with a one-call attention half
    and an MoE block with the native router (and no shared expert, or one with a :class:`NativeMLP` step); a
    gpt-oss decoder's :class:`~moeflow.engine.cpu_layers_gpt_oss.NativeGptOssLayers`; else None."""
    gpt_oss_step = native_gpt_oss_layers(decoder)
    if gpt_oss_step is not None:
        return gpt_oss_step
    layers = list(decoder.layers)
    blocks = []
    for layer in layers:
        block_of = LAYER_BLOCKS.get(type(layer))
        block = block_of(layer) if block_of is not None else None
        if not isinstance(layer.attention_step if block_of is not None else None, NativeAttentionHalf) \
                or not isinstance(block, MoEBlock) or not _native_shared(block.shared_expert) \
                or not isinstance(block.gate, NativeRouterGate) or not isinstance(block.route, NativeRoute):
            return None
        blocks.append(block)
    return NativeLayers(layers, blocks) if layers else None
