"""A lean CPU decode step (issue 21): the decoder's glue fused at load, on the CPU int4 path.

After :func:`~moeflow.engine.cpu_linears.quantize_decoder_linears`, when moeflow's CPU library is built and the
model runs in fp32, :func:`fuse_cpu_step` changes, in the built decoder:

* each plain attention layer (no QK-norm, no clamp, no biases): q/k/v become one matrix ``qkv_proj`` (one
  kernel call instead of three; q_proj/k_proj/v_proj stay as views of its rows, no second copy), and rotary +
  KV-cache write + attention run as one call (:func:`~moeflow.kernels.cpu_step_ops.attention_step`) whenever
  the cache is the engine's static one;
* each ``RMSNorm``: one call (:func:`~moeflow.kernels.cpu_step_ops.rmsnorm`), which also does the residual
  add before the post-attention norm;
* each decoder layer with an ``attention_half`` slot (Mixtral, the Llama-MoE layouts) whose q/k/v and o
  projections are int4/int8 (``attention_bits``, AWQ attention): its whole attention half - input norm,
  q/k/v, attention, o_proj, residual add, post-attention norm - as one call (:class:`NativeAttentionHalf`).

The weights and the formulas stay; the numerics differ from the unfused step only in summation order
(tests/test_cpu_step.py: logits within 1e-4 relative of the unfused step, greedy tokens equal).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeflow.families.layers import Attention, RMSNorm
from moeflow.kernels.cpu_native import Q4Matrix, native_available
from moeflow.kernels.cpu_quant_linear import CpuQuantLinear
from moeflow.kernels.cpu_step_ops import attention_block, block_linear_ok

QKV = ("q_proj", "k_proj", "v_proj")


def fuse_cpu_step(decoder: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Fuse ``decoder``'s attention layers and norms in place (see the module docstring); returns how many
    modules were changed ({"attention", "norm", "attention_half"}). Nothing changes without the native library
    or in 16-bit."""
    counts = {"attention": 0, "norm": 0, "attention_half": 0}
    if dtype != torch.float32 or not native_available():
        return counts
    for module in decoder.modules():
        if type(module) is RMSNorm and module.weight.dtype == torch.float32:
            module.native = True
            counts["norm"] += 1
        elif type(module) is Attention and module.qk_norm is None and module.clip_qkv is None:
            fused = fuse_qkv([getattr(module, name) for name in QKV])
            if fused is not None:
                module.qkv_proj, module.fused_step = fused, True
                counts["attention"] += 1
    for layer in getattr(decoder, "layers", []):
        half = _attention_half(layer)
        if half is not None:
            layer.attention_half = half
            counts["attention_half"] += 1
    return counts


class NativeAttentionHalf:
    """A decoder layer's attention half (input norm, q/k/v, attention, o_proj, residual add, post-attention
    norm) as one call (:func:`~moeflow.kernels.cpu_step_ops.attention_block`): the layer calls it with its
    attention's arguments and gets ``(x + attn, normed)``, or None when this step cannot take it (the modules'
    fused path switched off, a cache other than the static one, a non-fp32 input), and then runs its modules.
    Not a module: it holds the layer's own modules, no weights of its own."""

    def __init__(self, norm_in: RMSNorm, attn: Attention, norm_post: RMSNorm) -> None:
        self.norm_in, self.attn, self.norm_post = norm_in, attn, norm_post

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                 cache_position: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        attn = self.attn
        layer_kv = getattr(cache, "layer_kv", None)
        if not (attn.fused_step and self.norm_in.native and self.norm_post.native) or layer_kv is None \
                or x.dtype != torch.float32 or not x.is_contiguous() or not mask.is_contiguous():
            return None
        k_all, v_all = layer_kv[attn.layer_idx]
        if k_all.dtype != torch.float32:
            return None
        return attention_block(x, self.norm_in.weight, self.norm_post.weight, self.norm_in.eps, attn.qkv_proj,
                               attn.o_proj, attn.n_heads, attn.n_kv, cos, sin, k_all, v_all, cache_position, mask)


def _attention_half(layer: nn.Module) -> NativeAttentionHalf | None:
    """The layer's :class:`NativeAttentionHalf` when it has one to take (the Mixtral / Llama-MoE layer layout,
    quantized bias-free projections, both norms alike), else None."""
    parts = [getattr(layer, n, None) for n in ("input_layernorm", "self_attn", "post_attention_layernorm")]
    norm_in, attn, norm_post = parts
    if not hasattr(layer, "attention_half") or type(attn) is not Attention or not attn.fused_step or \
            any(type(n) is not RMSNorm or not n.native for n in (norm_in, norm_post)) or norm_in.eps != norm_post.eps:
        return None
    if not (block_linear_ok(attn.qkv_proj) and block_linear_ok(attn.o_proj)):
        return None
    return NativeAttentionHalf(norm_in, attn, norm_post)


def fuse_qkv(projections: list[nn.Module]) -> nn.Module | None:
    """One linear module whose output is the projections' outputs concatenated, or None when they cannot share
    one matrix (different kinds, formats or input sizes, biases). Each projection's weight tensors become views
    of the fused ones (so the memory is held once)."""
    first = projections[0]
    if any(getattr(p, "bias", None) is not None for p in projections):
        return None
    if all(type(p) is nn.Linear for p in projections):
        if len({(p.in_features, p.weight.dtype) for p in projections}) != 1:
            return None
        fused = nn.Linear(first.in_features, sum(p.out_features for p in projections), bias=False,
                          dtype=first.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in projections]), requires_grad=False)
        _share_rows(projections, fused, ["weight"])
        return fused
    if not all(isinstance(p, CpuQuantLinear) and p.native for p in projections):
        return None
    if len({(p.bits, p.in_features, p.group_size) for p in projections}) != 1:
        return None
    names = ["int8_weight", "int8_scales"] if first.bits == 8 else ["packed", "scales", "mins"]
    tensors = {n: torch.cat([getattr(p, n) for p in projections]) for n in names}
    out_features = sum(p.out_features for p in projections)
    if first.bits == 8:
        fused = CpuQuantLinear(8, first.in_features, out_features, int8_weight=tensors["int8_weight"],
                               int8_scales=tensors["int8_scales"])
    else:
        fused = CpuQuantLinear(4, first.in_features, out_features, int4=Q4Matrix(
            tensors["packed"], tensors["scales"], tensors["mins"], first.group_size))
    _share_rows(projections, fused, names)
    return fused


def _share_rows(projections: list[nn.Module], fused: nn.Module, names: list[str]) -> None:
    """Point each projection's ``names`` tensors at its rows of ``fused``'s (row blocks in projection order)."""
    start = 0
    for p in projections:
        for n in names:
            rows = getattr(fused, n).detach()[start:start + p.out_features]
            setattr(p, n, nn.Parameter(rows, requires_grad=False) if n in p._parameters else rows)
        start += p.out_features


def set_cpu_step_fused(decoder: nn.Module, fused: bool) -> None:
    """Switch a decoder :func:`fuse_cpu_step` changed between its fused and its unfused step (the same weights:
    q/k/v then run as their three views of the fused matrix) - for A/B benchmarks and tests."""
    for module in decoder.modules():
        if type(module) is RMSNorm and module.weight.dtype == torch.float32:
            module.native = fused and native_available()
        elif type(module) is Attention and module.qkv_proj is not None:
            module.fused_step = fused
