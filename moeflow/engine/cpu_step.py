"""A lean CPU decode step (issue 21): the decoder's glue fused at load, on the CPU int4 path.

After :func:`~moeflow.engine.cpu_linears.quantize_decoder_linears`, when moeflow's CPU library is built and the
model runs in fp32, :func:`fuse_cpu_step` changes, in the built decoder:

* each plain attention layer (no clamp, no biases; a QK-norm before the rotary, Qwen3's per head or OLMoE's
  over the projection, is computed inside the one call): q/k/v become one matrix ``qkv_proj`` (one
  kernel call instead of three; q_proj/k_proj/v_proj stay as views of its rows, no second copy), and rotary +
  KV-cache write + attention run as one call (:func:`~moeflow.kernels.cpu.step.attention_step`) whenever
  the cache is the engine's static one;
* each ``RMSNorm``: one call (:func:`~moeflow.kernels.cpu.step.rmsnorm`), which also does the residual
  add before the post-attention norm;
* each pre-norm decoder layer (``families.layers.PreNormLayer``: Mixtral, the Llama-MoE layouts) whose q/k/v and o
  projections are int4/int8 (``attention_bits``, AWQ attention): its whole attention half - input norm,
  q/k/v, attention, o_proj, residual add, post-attention norm - as one call (:class:`NativeAttentionHalf`);
* each dense SwiGLU MLP (a shared expert with Qwen2-MoE's sigmoid output gate, a dense layer) whose projections
  are native int4 of one form: the whole MLP as one call (:class:`NativeMLP`);
* each MoE block with a plain softmax-top-k router: its logits and its routing as one call each
  (:class:`NativeRouterGate`, :class:`NativeRoute`); every expert backend gets the same routing from them.

The weights and the formulas stay; the numerics differ from the unfused step only in summation order
(tests/test_cpu_step.py: logits within 1e-4 relative of the unfused step, greedy tokens equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.engine.cpu_layers_gpt_oss import fuse_gpt_oss, set_gpt_oss_fused
from moeflow.engine.kv_cache import PassCache
from moeflow.families.base import CausalDecoder
from moeflow.families.layers import Attention, GatedMLP, PreNormLayer, RMSNorm
from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.native import ROW_GROUP, native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, q4_fmt
from moeflow.kernels.cpu.q8_matrix import Q8Matrix
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, SplitLinear
from moeflow.kernels.cpu.step import (
    NATIVE_ATTENTION_TOKENS,
    attention_block,
    block_linear_ok,
    router_logits,
    shared_expert_step,
    softmax_topk,
)
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import Router


def fuse_cpu_step(decoder: CausalDecoder, dtype: torch.dtype) -> dict[str, int]:
    """Fuse ``decoder``'s attention layers and norms in place (see the module docstring); returns how many
    modules were changed ({"attention", "norm", "attention_half", "router", "mlp"}; "gpt_oss": gpt-oss layers
    given the one-call step's ops). Nothing changes without the native library or in 16-bit."""
    counts = {"attention": 0, "norm": 0, "attention_half": 0, "router": 0, "mlp": 0, "gpt_oss": 0}
    if dtype != torch.float32 or not native_available():
        return counts
    for module in decoder.modules():
        if type(module) is RMSNorm and module.weight.dtype == torch.float32:
            module.native = True
            counts["norm"] += 1
        elif type(module) is Attention and _native_qk_norm_ok(module) and module.clip_qkv is None \
                and module.rotary_dim == module.head_dim:
            fused = fuse_qkv([module.q_proj, module.k_proj, module.v_proj])
            if fused is not None:
                module.qkv_proj, module.fused_qkv, module.fused_step = fused, True, True
                counts["attention"] += 1
        elif type(module) is GatedMLP:
            step = NativeMLP.of(module)
            if step is not None:
                module.native_step = step
                counts["mlp"] += 1
    for block in [m for m in decoder.modules() if isinstance(m, MoEBlock)]:
        counts["router"] += _native_router(block)
    counts["gpt_oss"] = fuse_gpt_oss(decoder)  # gpt-oss layers: the one-call step's own ops (cpu_layers_gpt_oss)
    for layer in decoder.layers:
        half = _attention_half(layer)
        if half is not None:
            layer.set_attention_step(half)
            counts["attention_half"] += 1
    return counts


def _native_qk_norm_ok(attn: Attention) -> bool:
    """Whether the CPU library's attention computes ``attn``'s QK-norm: none, or RMSNorm before the rotary per head
    (Qwen3) or over the projection (OLMoE), fp32 weights, one eps."""
    if attn.qk_norm is None:
        return True
    norms = (attn.q_norm, attn.k_norm)
    return attn.qk_norm in ("head", "projection") and all(type(n) is RMSNorm and n.weight.dtype == torch.float32
                                                           for n in norms) and attn.q_norm.eps == attn.k_norm.eps


class NativeAttentionHalf:
    """A decoder layer's attention half (input norm, q/k/v, attention, o_proj, residual add, post-attention
    norm) as one call (:func:`~moeflow.kernels.cpu.step.attention_block`): the layer calls it with its
    attention's arguments and gets ``(x + attn, normed)``, or None when this step cannot take it (the modules'
    fused path switched off, a cache other than the static one, a non-fp32 input), and then runs its modules.
    Not a module: it holds the layer's own modules, no weights of its own."""

    def __init__(self, norm_in: RMSNorm, attn: Attention, norm_post: RMSNorm) -> None:
        self.norm_in, self.attn, self.norm_post = norm_in, attn, norm_post

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PassCache,
                 cache_position: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        attn = self.attn
        layer_kv = cache.layer_kv
        if not (attn.fused_step and self.norm_in.native and self.norm_post.native) or layer_kv is None \
                or x.shape[1] > NATIVE_ATTENTION_TOKENS or x.dtype != torch.float32 or not x.is_contiguous() \
                or not mask.is_contiguous():
            return None
        k_all, v_all = layer_kv[attn.layer_idx]
        if k_all.dtype != torch.float32:
            return None
        return attention_block(x, self.norm_in.weight, self.norm_post.weight, self.norm_in.eps, attn.qkv_proj,
                               attn.o_proj, attn.n_heads, attn.n_kv, cos, sin, k_all, v_all, cache_position, mask,
                               attn.native_qk_norm())


class NativeMLP:
    """A dense SwiGLU MLP (a shared expert, with Qwen2-MoE's sigmoid output gate, or a dense layer) as one call
    (:func:`~moeflow.kernels.cpu.step.shared_expert_step`, ``native``), its gate and up rows one q4 matrix (the
    modules' tensors become views of it). Not a module: it holds the MLP's weights, no copy."""

    def __init__(self, w13: Q4Matrix, w2: Q4Matrix, gate: torch.Tensor | None) -> None:
        self.w13, self.w2, self.gate, self.native = w13, w2, gate, True

    @classmethod
    def of(cls, mlp: GatedMLP) -> NativeMLP | None:
        """``mlp``'s native step when its three projections are native int4 without bias, of one group size and
        form of scales (and its output gate, if any, fp32 without bias); else None (nothing changed)."""
        projections = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        og = mlp.output_gate
        if not all(isinstance(p, CpuQuantLinear) and p.native and p.bits == 4 and p.bias is None for p in projections) \
                or len({(p.group_size, q4_fmt(p.scales, p.mins)) for p in projections}) != 1 \
                or (og is not None and (og.bias is not None or og.weight.dtype != torch.float32)):
            return None
        w13 = _fuse_one(projections[:2])
        if w13 is None:
            return None
        down = mlp.down_proj
        return cls(Q4Matrix(w13.packed, w13.scales, w13.mins, w13.group_size),
                   Q4Matrix(down.packed, down.scales, down.mins, down.group_size),
                   None if og is None else og.weight.detach().reshape(-1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., H] -> [..., H], or None when the native step is off or x is not contiguous fp32."""
        if not self.native or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        return shared_expert_step(x.reshape(-1, x.shape[-1]), self.w13, self.w2, self.gate).view(x.shape)


class NativeRouterGate(nn.Module):
    """A plain router's linear layer (the MoE block's ``gate``, its weight kept as ``weight``) computed by
    :func:`~moeflow.kernels.cpu.step.router_logits` (``native``) or ``F.linear``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.native = weight, True
        self.out_features, self.in_features = weight.shape  # as the nn.Linear it replaces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E]."""
        if self.native and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            return router_logits(x, self.weight)
        return F.linear(x, self.weight)


class NativeRoute:
    """A plain softmax-top-k router (the MoE block's ``route``) as one native call (``native``), else the
    block's own router function it replaced."""

    def __init__(self, route: Router, top_k: int, renormalize: bool) -> None:
        self.fallback, self.top_k, self.renormalize, self.native = route, top_k, renormalize, True

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.native and logits.dtype == torch.float32 and logits.is_contiguous():
            return softmax_topk(logits, self.top_k, self.renormalize)
        return self.fallback(logits)


def _native_router(block: MoEBlock) -> bool:
    """Give ``block`` the native gate and route when its router is a plain softmax top-k on fp32 weights."""
    gate = block.gate
    if block.kernel_routing is None or block.router.scaling_factor != 1.0 or type(gate) is not nn.Linear or \
            gate.bias is not None or gate.weight.dtype != torch.float32:
        return False
    block.gate = NativeRouterGate(gate.weight)
    block.route = NativeRoute(block.route, block.kernel_routing.top_k, block.kernel_routing.renormalize)
    return True


def _attention_half(layer: nn.Module) -> NativeAttentionHalf | None:
    """The layer's :class:`NativeAttentionHalf` when it has one to take (the Mixtral / Llama-MoE layer layout,
    quantized bias-free projections, both norms alike), else None."""
    if not isinstance(layer, PreNormLayer):
        return None
    norm_in, attn, norm_post = layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm
    if type(attn) is not Attention or not attn.fused_step or \
            any(type(n) is not RMSNorm or not n.native for n in (norm_in, norm_post)) or norm_in.eps != norm_post.eps:
        return None
    if not (block_linear_ok(attn.qkv_proj, bias=True) and block_linear_ok(attn.o_proj)):
        return None
    return NativeAttentionHalf(norm_in, attn, norm_post)


def fuse_qkv(projections: list[nn.Module]) -> nn.Module | None:
    """One linear module whose output is the projections' outputs concatenated, or None when they cannot share
    one matrix (different kinds, formats or input sizes, biases). Each projection's weight tensors become views
    of the fused ones (so the memory is held once). Native q, k, v layers of two forms (a GGUF file's Q4_0 q, Q8_0
    k and v) make a :class:`SplitLinear` of q and the fused k/v instead. GGUF layers of one block type
    (:class:`GGUFLinear`: a file's Q8_0 / Q5_K / Q6_K projections on its blocks) fuse as their rows of blocks."""
    fused = _fuse_one(projections)
    if fused is None and len(projections) == 3 and all((isinstance(p, CpuQuantLinear) and p.native)
                                                       or isinstance(p, GGUFLinear) for p in projections):
        kv = _fuse_one(projections[1:])
        if kv is not None and projections[0].bias is None:
            return SplitLinear((projections[0], kv))
    return fused


def _fuse_one(projections: list[nn.Module]) -> nn.Module | None:
    first = projections[0]
    biased = [p.bias is not None for p in projections]
    if any(biased) and not (all(biased) and all(isinstance(p, (CpuQuantLinear, GGUFLinear)) for p in projections)):
        return None  # (native layers: all biased, Qwen2's q/k/v, or none)
    if all(isinstance(p, GGUFLinear) for p in projections):
        if len({(p.type.type_id, p.in_features) for p in projections}) != 1:
            return None
        fused = GGUFLinear(hugepages.cat([p.blocks for p in projections]), first.type, first.in_features)
        _share_rows(projections, fused, ["blocks"])
        if all(biased):
            fused.set_bias(torch.cat([p.bias for p in projections]))
            _share_rows(projections, fused, ["bias"])
        return fused
    if all(type(p) is nn.Linear for p in projections):
        if len({(p.in_features, p.weight.dtype) for p in projections}) != 1:
            return None
        fused = nn.Linear(first.in_features, sum(p.out_features for p in projections), bias=False,
                          dtype=first.weight.dtype)
        fused.weight = nn.Parameter(hugepages.cat([p.weight.detach() for p in projections]), requires_grad=False)
        _share_rows(projections, fused, ["weight"])
        return fused
    if not all(isinstance(p, CpuQuantLinear) and p.native for p in projections):
        return None
    if len({(p.bits, p.in_features, p.group_size, q4_fmt(p.scales, p.mins) if p.bits == 4 else None)
            for p in projections}) != 1:
        return None  # (int4: one form of scales, Q4Matrix.fmt)
    if any(p.out_features % ROW_GROUP for p in projections):
        return None  # int4/int8 rows are interleaved in groups of ROW_GROUP: row views are valid only at group bounds
    names = ["int8_weight", "int8_scales"] if first.bits == 8 else ["packed", "scales", "mins"]
    tensors = {n: hugepages.cat([getattr(p, n) for p in projections]) for n in names}  # (the forms: huge pages)
    out_features = sum(p.out_features for p in projections)
    if first.bits == 8:
        fused = CpuQuantLinear(8, first.in_features, out_features,
                               int8=Q8Matrix(tensors["int8_weight"], tensors["int8_scales"]))
    else:
        fused = CpuQuantLinear(4, first.in_features, out_features, int4=Q4Matrix(
            tensors["packed"], tensors["scales"], tensors["mins"], first.group_size))
    _share_rows(projections, fused, names)
    if all(biased):
        fused.set_bias(torch.cat([p.bias for p in projections]))
        _share_rows(projections, fused, ["bias"])
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
    q/k/v then run as their three views of the fused matrix) - for A/B benchmarks and tests. The decoder's
    one-call layers (engine.cpu_layers), when it has them, are switched with the rest."""
    if isinstance(decoder, CausalDecoder) and decoder.layers_step is not None:
        decoder.layers_step.enabled = fused
    set_gpt_oss_fused(decoder, fused)
    for module in decoder.modules():
        if type(module) is RMSNorm and module.weight.dtype == torch.float32:
            module.native = fused and native_available()
        elif type(module) is Attention and module.qkv_proj is not None:
            module.fused_qkv = module.fused_step = fused
        elif isinstance(module, NativeRouterGate):
            module.native = fused
        elif type(module) is GatedMLP and isinstance(module.native_step, NativeMLP):
            module.native_step.native = fused
        elif isinstance(module, MoEBlock) and isinstance(module.route, NativeRoute):
            module.route.native = fused
