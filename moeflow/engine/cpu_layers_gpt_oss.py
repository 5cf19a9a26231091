"""gpt-oss's one-token CPU decode step through every decoder layer as one native call (issue 42).

:func:`native_gpt_oss_layers` (called by :func:`~moeflow.engine.cpu_layers.native_layers`) gives a gpt-oss decoder
a :class:`NativeGptOssLayers`, which the decoder runs each pass (``CausalDecoder.set_layers_step``). It takes a pass
when: one token, fp32, the engine's static cache, every attention projection on the per-layer path's native kernels
(int8 / int4 :class:`~moeflow.kernels.cpu.quant_linear.CpuQuantLinear` or a GGUF file's blocks,
:func:`~moeflow.kernels.cpu.gpt_oss_step.proj_desc`: the default ``attention_bits="auto"``), the experts MXFP4 in a
CPU pool computed by ``mxfp4.c`` (``MXFP4Format.cpu_kernels``: ``device="cpu"``), no routing to record, no module
hooks. Otherwise it returns None and the layers run one by one. The projections and the experts are the per-layer
path's numbers bit for bit; the norms, the attention with its sinks and the router are its formulas in C
(:mod:`moeflow.kernels.cpu.gpt_oss_step`). :meth:`NativeGptOssLayers.logits` runs the tail (the final norm and the
lm_head) in the same call, as the Mixtral-style step does (``NativeLayers.logits``): the per-call head's logits bit
for bit; a hook on the norm or the head, or a head it does not take, leaves the tail to Python.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from moeflow.engine.kv_cache import PassCache
from moeflow.engine.one_token_pass import LayerCaches, TailHead, one_real_token, pass_caches
from moeflow.families import gpt_oss
from moeflow.families.base import CausalDecoder
from moeflow.kernels.cpu.decode_loop import LoopParts
from moeflow.kernels.cpu.gpt_oss_step import (
    GptOssLayerDesc,
    MxExpertDesc,
    gpt_oss_layer_desc,
    gpt_oss_step,
    proj_desc,
    topk_softmax,
)
from moeflow.kernels.cpu.mxfp4_native import region_layout
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.step import router_logits
from moeflow.kernels.dispatch import uses_triton
from moeflow.kernels.formats.mxfp4 import MXFP4Format
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import MoEBlock, RoutingRecorder
from moeflow.moe.resident import ResidentExperts
from moeflow.moe.routing import Router

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class NativeBiasedGate(nn.Module):
    """gpt-oss's router linear layer (the MoE block's ``gate``: ``weight`` fp32 [E, H], ``bias`` fp32 [E] kept)
    computed as the one-call step does (``native``): :func:`~moeflow.kernels.cpu.step.router_logits`, then one add
    per logit; else ``F.linear``."""

    def __init__(self, gate: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias, self.native = gate.weight, gate.bias, True
        self.out_features, self.in_features = gate.weight.shape  # as the nn.Linear it replaces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E]."""
        if self.native and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            logits = router_logits(x, self.weight)
            if self.bias is not None:
                logits += self.bias
            return logits
        return nn.functional.linear(x, self.weight, self.bias)


class NativeTopkSoftmax:
    """gpt-oss's routing (the MoE block's ``route``: top-k logits, their softmax) as the one-call step routes
    (``native``: :func:`~moeflow.kernels.cpu.gpt_oss_step.topk_softmax`), else the block's own router function."""

    def __init__(self, route: Router, top_k: int) -> None:
        self.fallback, self.top_k, self.native = route, top_k, True

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.native and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous():
            return topk_softmax(logits, self.top_k)
        return self.fallback(logits)


def _gpt_oss_router(block: MoEBlock) -> bool:
    spec, gate = block.router, block.gate
    return type(gate) is nn.Linear and gate.weight.dtype == torch.float32 and \
        (gate.bias is None or gate.bias.dtype == torch.float32) and spec.topk_before_scoring and \
        spec.scoring == "softmax" and not spec.selection_bias and spec.n_groups == 1 and spec.scaling_factor == 1.0


def fuse_gpt_oss(decoder: nn.Module) -> int:
    """On the CPU path (fp32, moeflow's CPU library built; called by :func:`~moeflow.engine.cpu_step.fuse_cpu_step`):
    give each gpt-oss layer of ``decoder`` the one-call step's own ops for its norms, its one-token attention and
    its router (:class:`NativeBiasedGate`, :class:`NativeTopkSoftmax`), so that the layers one by one compute what
    :class:`NativeGptOssLayers` computes in one call, bit for bit (the projections and experts already run the same
    kernels). Returns how many layers were changed."""
    if not native_available():
        return 0
    count = 0
    for layer in getattr(decoder, "layers", []):
        if type(layer) is not gpt_oss.DecoderLayer or not _gpt_oss_router(layer.mlp):
            continue
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if any(n.weight.dtype != torch.float32 for n in norms) or layer.self_attn.sinks.dtype != torch.float32:
            continue
        for n in norms:
            n.native = True
        layer.self_attn.native = True
        block = layer.mlp
        block.gate = NativeBiasedGate(block.gate)
        block.route = NativeTopkSoftmax(block.route, block.top_k)
        count += 1
    final = getattr(decoder, "norm", None)
    if count and isinstance(final, gpt_oss.GptOssRMSNorm) and final.weight.dtype == torch.float32:
        final.native = True
    return count


def set_gpt_oss_fused(decoder: nn.Module, fused: bool) -> None:
    """Switch what :func:`fuse_gpt_oss` gave ``decoder`` on or off (:func:`~moeflow.engine.cpu_step.set_cpu_step_fused`;
    off: the torch ops)."""
    layers = [m for m in getattr(decoder, "layers", []) if type(m) is gpt_oss.DecoderLayer]
    if not layers or not isinstance(layers[0].mlp.gate, NativeBiasedGate):
        return
    final = getattr(decoder, "norm", None)
    for layer in layers:
        for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp.gate,
                  layer.mlp.route):
            m.native = fused
    if isinstance(final, gpt_oss.GptOssRMSNorm) and final.weight.dtype == torch.float32:
        final.native = fused


def native_mxfp4_experts(experts: ExpertBackend) -> bool:
    """Whether the per-layer path computes ``experts`` with ``mxfp4.c`` on a CPU pool's region bytes (what the one
    call computes): MXFP4 experts resident in a CPU pool, ``cpu_kernels`` on, not on the Triton kernels."""
    return type(experts) is ResidentExperts and isinstance(experts.fmt, MXFP4Format) and experts.fmt.cpu_kernels \
        and experts.pool.device.type == "cpu" and not uses_triton(experts.kernels_backend, experts.pool.device)


class NativeGptOssLayers:
    """A gpt-oss decoder's layers as one native call for one-token steps (module docstring). ``enabled``: switched
    by :func:`~moeflow.engine.cpu_step.set_cpu_step_fused` (and by tests, for the per-layer path)."""

    def __init__(self, layers: list[gpt_oss.DecoderLayer]) -> None:
        self.layers, self.enabled = layers, True
        self.modules = [m for layer in layers for m in (layer, layer.input_layernorm, layer.self_attn,
                                                        layer.post_attention_layernorm, layer.mlp, layer.mlp.gate,
                                                        *(getattr(layer.self_attn, n) for n in PROJECTIONS))]
        self._descs: tuple[Any, ctypes.Array, list] | None = None  # (backend, descriptors, what they point into)
        self._tail = TailHead(gpt_oss.GptOssRMSNorm)  # the final norm and lm_head's descriptor
        self._kv = LayerCaches()  # each layer's (k, v) cache, checked once per cache

    def _fused(self) -> bool:
        """Whether every layer takes the step's own ops (fuse_gpt_oss' switches on) and no module is hooked."""
        for layer in self.layers:
            block = layer.mlp
            if not (layer.input_layernorm.native and layer.post_attention_layernorm.native and layer.self_attn.native
                    and isinstance(block.gate, NativeBiasedGate) and block.gate.native
                    and isinstance(block.route, NativeTopkSoftmax) and block.route.native):
                return False
        return not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in self.modules))

    def _descriptors(self, experts: ResidentExperts) -> ctypes.Array | None:
        """The layers' descriptors for this backend (built once; None when a projection is not on a native kernel)."""
        if self._descs is not None and self._descs[0] is experts:
            return self._descs[1]
        fmt, pool = experts.fmt, experts.pool
        buffer = pool.buffer
        if buffer.dim() != 2 or not buffer.is_contiguous() or buffer.shape[1] != fmt.nbytes:
            return None
        layout = region_layout(fmt, buffer[0], {name: v[0] for name, v in pool.tensors.items()})
        base, keep, descs = buffer.data_ptr(), [], []
        for layer in self.layers:
            attn, block = layer.self_attn, layer.mlp
            projections = [proj_desc(getattr(attn, n)) for n in PROJECTIONS]
            if any(p is None for p in projections):
                return None
            regions = []
            for slot in experts.slot_tables[block.layer_idx].tolist():
                at = base + slot * fmt.nbytes
                b13, s13, c13, b2, s2, c2 = (at + o if o >= 0 else None for o in layout.offsets)
                regions.append(MxExpertDesc(b13, s13, b2, s2, c13, c2))
            gate_bias = block.gate.bias.detach() if block.gate.bias is not None else None
            desc, table = gpt_oss_layer_desc(
                layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                layer.input_layernorm.eps, projections, attn.n_heads, attn.n_kv, attn.head_dim,
                attn.sinks.detach(), block.gate.weight.detach(), gate_bias, block.top_k, regions, layout.inter,
                (layout.p13, layout.p2), layout.bias_kind, layout.activation, layout.alpha, layout.limit)
            descs.append(desc)
            keep.append(table)
        array = (GptOssLayerDesc * len(descs))(*descs)
        self._descs = (experts, array, keep)
        return array

    def _take(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
              cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
              routing: RoutingRecorder | None) -> tuple[ctypes.Array, list[tuple[torch.Tensor, ...]]] | None:
        """(the layers' descriptors, each layer's (k cache, v cache, mask)) when this pass is one the native call
        takes, else None (module docstring)."""
        layer_kv = cache.layer_kv
        if not self.enabled or layer_kv is None or not one_real_token(x, routing, experts) \
                or not native_mxfp4_experts(experts) or not self._fused():
            return None
        kv = self._kv(layer_kv, lambda: [layer.self_attn.layer_idx for layer in self.layers])
        caches = None if kv is None else pass_caches(kv, masks, cos, sin, cache_position)
        if caches is None:
            return None
        descs = self._descriptors(experts)
        return None if descs is None else (descs, caches)

    def loop_parts(self, cache: PassCache, experts: ExpertBackend, norm: nn.Module, lm_head: nn.Module
                   ) -> LoopParts | None:
        """The step's :class:`~moeflow.kernels.cpu.decode_loop.LoopParts` for a greedy loop of one-token passes
        (:mod:`moeflow.engine.native_decode`) when :meth:`logits` would take such a pass on ``cache`` with these
        ``experts``, ``norm`` and ``lm_head``, else None: the checks of :meth:`_take` that do not depend on the
        pass's own tensors (the loop makes those itself: one fp32 token, cos / sin, each layer's window's mask)."""
        head = self._tail.desc(norm, lm_head)
        layer_kv = cache.layer_kv
        if head is None or not self.enabled or layer_kv is None or not native_mxfp4_experts(experts) \
                or not self._fused():
            return None
        kv = self._kv(layer_kv, lambda: [layer.self_attn.layer_idx for layer in self.layers])
        descs = None if kv is None else self._descriptors(experts)
        return None if descs is None else LoopParts("gpt_oss", descs, head, kv, self.layers[0].self_attn.scaling)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
                 cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
                 routing: RoutingRecorder | None) -> torch.Tensor | None:
        """x fp32 [1, 1, H] after every layer, or None when this pass is not one it takes (module docstring).
        ``masks``: each layer's attention mask bool [1, 1, 1, L] (its sliding window)."""
        taken = self._take(x, cos, sin, cache, cache_position, masks, experts, routing)
        if taken is None:
            return None
        return gpt_oss_step(taken[0], x.contiguous(), cos, sin, taken[1], cache_position,
                            self.layers[0].self_attn.scaling)

    def logits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
               cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
               routing: RoutingRecorder | None, norm: nn.Module, lm_head: nn.Module) -> torch.Tensor | None:
        """The pass's logits fp32 [1, 1, V] = ``lm_head(norm(x after every layer))`` with the tail in the same
        native call (:func:`~moeflow.kernels.cpu.gpt_oss_step.gpt_oss_step` with a ``head``: step_head.c's code,
        the per-call head's numbers bit for bit), or None (nothing run) when the pass is not one :meth:`__call__`
        takes, or ``norm`` / ``lm_head`` are not the native GptOssRMSNorm and an int8/int4 CpuQuantLinear, a
        GGUFLinear or a RefinedInt4LmHead (:func:`~moeflow.kernels.cpu.layers.head_ok`; a hook on either: the
        decoder calls :meth:`__call__` and runs its norm and head in Python)."""
        head = self._tail.desc(norm, lm_head)
        if head is None:
            return None
        taken = self._take(x, cos, sin, cache, cache_position, masks, experts, routing)
        if taken is None:
            return None
        logits = torch.empty((1, 1, lm_head.out_features))
        gpt_oss_step(taken[0], x.contiguous(), cos, sin, taken[1], cache_position, self.layers[0].self_attn.scaling,
                     head=head, logits=logits)
        return logits


def native_gpt_oss_layers(decoder: CausalDecoder) -> NativeGptOssLayers | None:
    """The decoder's :class:`NativeGptOssLayers` when every layer is a gpt-oss layer :func:`fuse_gpt_oss` gave the
    step's ops (fp32 norms, sinks and router, gpt-oss's top-k-then-softmax routing); else None. (The projections
    and the experts are checked per pass: :meth:`NativeGptOssLayers.__call__`.)"""
    layers = list(decoder.layers)
    if not layers or not all(type(layer) is gpt_oss.DecoderLayer and isinstance(layer.mlp.gate, NativeBiasedGate)
                             and layer.mlp.shared_expert is None
                             and layer.input_layernorm.eps == layer.post_attention_layernorm.eps for layer in layers):
        return None
    return NativeGptOssLayers(layers)
