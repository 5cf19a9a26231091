"""The glue of a CPU decode step as single calls into moeflow's CPU library (``step.c``, built with native.c).

A decode step on the CPU reads ~140 MB of 4-bit weights in ~15 ms; what it used to spend beside that was ~190
small torch ops per layer (RMSNorm's pow/mean/rsqrt/mul chain, rotary's slices and cats, the KV-cache
``index_copy_``, SDPA's set-up), each a few microseconds of dispatch on one core. These ops do that glue in one
call each, fp32 in and out:

* :func:`rmsnorm`: ``w * (x / sqrt(mean(x^2) + eps))``, optionally after the residual add ``x + res``;
* :func:`attention_step`: rotary on q and k, k/v written into the static cache, softmax attention of every
  query head over the positions its mask allows, from the fused q/k/v projection's output; optionally after a
  QK-norm (:class:`QKNorm`: RMSNorm of q and k per head, Qwen3, or over the whole projection, OLMoE), which is
  :func:`rmsnorm`'s op on those rows.

Numerics (the fp32 torch models below: :func:`rmsnorm_reference`, :func:`attention_step_reference`): the same
formulas in fp32; the rotary and the residual add round exactly as torch's unfused ops (the cache gets the
same keys), the norm's mean of squares is summed in double, the attention's dot products and softmax in fp32 in
another order than SDPA's (relative differences ~1e-6).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.matrix_reference import q4_expert_reference
from moeflow.kernels.cpu.native import declared, library
from moeflow.kernels.cpu.q4_matrix import Q4_F32, Q4Matrix, q4_fmt
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, SplitLinear

# tokens per sequence up to which the attention op runs (decode, short prompts); beyond, SDPA's blocked GEMMs
# beat its loop over queries and positions
NATIVE_ATTENTION_TOKENS = 16
LINEAR_GGUF = 64  # step.h's MF_LINEAR_GGUF: an mf_linear of a GGUF file's blocks (GGUFLinear)
QK_HEAD, QK_PROJECTION = 1, 2  # native.h's MF_QK_HEAD, MF_QK_PROJ


@dataclass(frozen=True)
class QKNorm:
    """A QK-norm before the rotary: RMSNorm of the queries and the keys with weights ``q``, ``k`` (fp32,
    contiguous) and ``eps``; ``per_head``: over each head's D features (q, k [D], Qwen3), else over each token's
    whole projection (q [n_heads D], k [n_kv D], OLMoE)."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float
    per_head: bool

    def check(self, n_heads: int, n_kv: int, d: int) -> None:
        _check_fp32("q_norm", self.q)
        _check_fp32("k_norm", self.k)
        want = (d, d) if self.per_head else (n_heads * d, n_kv * d)
        if (self.q.numel(), self.k.numel()) != want:
            raise ValueError(f"QK-norm weights q {tuple(self.q.shape)}, k {tuple(self.k.shape)}: expected {want[0]} "
                             f"and {want[1]} values ({'per head' if self.per_head else 'per projection'})")


def qk_norm_args(norm: QKNorm | None) -> tuple:
    """mf_attn_step's (qk, qn, kn, qk_eps) arguments for ``norm`` (None: no QK-norm)."""
    if norm is None:
        return 0, None, None, 0.0
    return QK_HEAD if norm.per_head else QK_PROJECTION, norm.q.data_ptr(), norm.k.data_ptr(), norm.eps


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.mf_rmsnorm.argtypes = [p, p, p, p, f, i, i, p]
    lib.mf_rmsnorm.restype = None
    lib.mf_attn_step.argtypes = [p, i, i, i, i, i, p, p, p, p, i, p, p, f, i, p, p, f, p, i]
    lib.mf_attn_step.restype = i
    lib.mf_attn_block.argtypes = [p, i, i, i, p, p, f, i, i, i, p, p, p, i, i, i, p, p, p, i, i, i, p, p, p,
                                  i, i, i, p, i, p, p, f, p, p, p, p, i, p, p, f, p, p, i]
    lib.mf_attn_block.restype = i
    lib.mf_dense_f32.argtypes = [p, i, i, i, p, p]
    lib.mf_dense_f32.restype = None
    lib.mf_softmax_topk.argtypes = [p, i, i, i, i, p, p, p]
    lib.mf_softmax_topk.restype = None
    lib.mf_shared_expert.argtypes = [p, i, i, i, i, i, p, p, p, p, p, p, p, p, i, i]
    lib.mf_shared_expert.restype = i


def _lib() -> ctypes.CDLL:
    """The library with this section's functions declared (once per loaded library)."""
    lib = library()
    if lib is None:
        raise RuntimeError("moeflow's CPU kernels are unavailable here (see moeflow.kernels.cpu.native)")
    return declared(lib, _signatures)


def _check_fp32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on "
                         f"{t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")


def _check_attention_args(b: int, t: int, n_heads: int, n_kv: int, d: int, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, cache_position: torch.Tensor,
                          mask: torch.Tensor) -> None:
    for name, x in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_fp32(name, x)
    length = k_cache.shape[2]
    if tuple(k_cache.shape) != (b, n_kv, length, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}: expected "
                         f"[{b}, {n_kv}, L, {d}] for {n_heads} query heads of {d} features")
    if tuple(cos.shape) != (b, t, d) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)}: expected [{b}, {t}, {d}]")
    if mask.dtype != torch.bool or tuple(mask.shape) != (b, 1, t, length) or not mask.is_contiguous():
        raise ValueError(f"mask: expected contiguous bool [{b}, 1, {t}, {length}], got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    if cache_position.dtype != torch.int64 or cache_position.shape != (t,):
        raise ValueError(f"cache_position: expected int64 [{t}], got {cache_position.dtype} "
                         f"{tuple(cache_position.shape)}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x fp32 [..., H], weight fp32 [H] -> (normed fp32 [..., H], x + residual or None).

    With ``residual`` [..., H] the sum ``x + residual`` is normalised (and returned: the residual stream)."""
    _check_fp32("x", x)
    _check_fp32("weight", weight)
    h = x.shape[-1]
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        _check_fp32("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
        total = torch.empty_like(x)
    _lib().mf_rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                      None if total is None else total.data_ptr(), weight.data_ptr(), eps, x.numel() // h, h,
                      out.data_ptr())
    return out, total


def attention_step(qkv: torch.Tensor, n_heads: int, n_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, cache_position: torch.Tensor,
                   mask: torch.Tensor, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """One attention layer after its fused projection; writes this step's keys and values into the cache.

    qkv fp32 [B, T, (n_heads + 2 n_kv) D] (q heads, k heads, v heads); cos, sin fp32 [B, T, D];
    k_cache, v_cache fp32 [B, n_kv, L, D] (this layer's, contiguous); cache_position int64 [T];
    mask bool [B, 1, T, L]; ``qk_norm``: the QK-norm before the rotary, if any
    -> fp32 [B, T, n_heads D] (heads concatenated, ready for o_proj)."""
    b, t, features = qkv.shape
    d = features // (n_heads + 2 * n_kv)
    _check_fp32("qkv", qkv)
    _check_attention_args(b, t, n_heads, n_kv, d, cos, sin, k_cache, v_cache, cache_position, mask)
    if qk_norm is not None:
        qk_norm.check(n_heads, n_kv, d)
    out = torch.empty((b, t, n_heads * d), dtype=torch.float32)
    rc = _lib().mf_attn_step(qkv.data_ptr(), b, t, n_heads, n_kv, d, cos.data_ptr(), sin.data_ptr(),
                             k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], cache_position.data_ptr(),
                             mask.data_ptr(), 1.0 / math.sqrt(d), *qk_norm_args(qk_norm), out.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise MemoryError("attention_step: the CPU kernel could not allocate its score buffers")
    return out


def attention_block(x: torch.Tensor, norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float,
                    qkv: CpuQuantLinear | SplitLinear, o: CpuQuantLinear, n_heads: int, n_kv: int, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_position: torch.Tensor,
                    mask: torch.Tensor, qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's attention half in one call: x fp32 [B, T, H] -> (x + attn, rmsnorm(x + attn, norm_post)),
    where attn = o(attention_step(qkv(rmsnorm(x, norm_in)))), each fp32 [B, T, H]; writes this step's keys
    and values into the cache. ``qkv``, ``o``: native int4/int8 :class:`CpuQuantLinear` without bias (``qkv``: or a
    :class:`SplitLinear` of two, q's rows and k's and v's); the other arguments (``qk_norm`` too) as
    :func:`rmsnorm` and :func:`attention_step`. The same kernels in the same order as those calls. ``qkv`` may
    have a bias (added after the projection, as the layer's own forward adds it)."""
    b, t, h = x.shape
    d = qkv.out_features // (n_heads + 2 * n_kv)
    _check_fp32("x", x)
    _check_attention_args(b, t, n_heads, n_kv, d, cos, sin, k_cache, v_cache, cache_position, mask)
    if qk_norm is not None:
        qk_norm.check(n_heads, n_kv, d)
    x_out, h_out = torch.empty_like(x), torch.empty_like(x)
    rc = _lib().mf_attn_block(x.data_ptr(), b, t, h, norm_in.data_ptr(), norm_post.data_ptr(), eps,
                              *qkv_args(qkv), *_linear_args(o), n_heads, n_kv, k_cache.shape[3], bias_arg(qkv),
                              *qk_norm_args(qk_norm), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(),
                              k_cache.shape[2], cache_position.data_ptr(), mask.data_ptr(),
                              1.0 / math.sqrt(k_cache.shape[3]), x_out.data_ptr(), h_out.data_ptr(),
                              torch.get_num_threads())
    if rc:
        raise MemoryError("attention_block: the CPU kernel could not allocate its buffers")
    return x_out, h_out


def experts_step(x: torch.Tensor, experts: list[tuple[Q4Matrix, Q4Matrix]], weights: torch.Tensor) -> torch.Tensor:
    """One token through its k experts, summed in k order: x fp32 [1, H], experts [(w13 [2I, H], w2 [H, I])] * k,
    weights fp32 [1, k] -> fp32 [1, H]. The same kernel calls and order as k :func:`q4_expert` calls that
    accumulate into one output (so the same numbers), without the per-call tensor set-up of that wrapper."""
    _check_fp32("x", x)
    _check_fp32("weights", weights)
    if weights.shape != (1, len(experts)) or x.shape[0] != 1:
        raise ValueError(f"experts_step takes one token: x {tuple(x.shape)}, weights {tuple(weights.shape)} for "
                         f"{len(experts)} experts")
    out = torch.empty_like(x)
    for j, (w13, w2) in enumerate(experts):
        _q4_expert_row(x, w13, w2, weights.data_ptr() + 4 * j, out.data_ptr(), accumulate=j > 0, what="experts_step")
    return out


def _q4_expert_row(x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, weight_ptr: int, out_ptr: int, accumulate: bool,
                   what: str) -> None:
    """One token x fp32 [1, H] through one expert, weighted by the fp32 at ``weight_ptr``, written to (or added
    into) the fp32 row [H] at ``out_ptr``: ``mf_q4_expert`` called directly (no tensor set-up)."""
    if w13.fmt != w2.fmt:
        w13, w2 = w13.fp32_form(), w2.fp32_form()
    rc = library().mf_q4_expert(x.data_ptr(), 1, w2.packed.shape[0], w2.packed.shape[1] * 2, w13.group_size,
                                w13.fmt, w13.packed.data_ptr(), w13.scales.data_ptr(), w13.mins.data_ptr(),
                                w2.packed.data_ptr(), w2.scales.data_ptr(), w2.mins.data_ptr(), weight_ptr, out_ptr,
                                int(accumulate), torch.get_num_threads())
    if rc:
        raise MemoryError(f"{what}: the CPU kernel could not allocate its activation buffers")


def expert_row(x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, weights: torch.Tensor, j: int,
               out: torch.Tensor) -> None:
    """One token through one expert into row ``j`` of ``out``: x fp32 [1, H], weights fp32 [k] (contiguous; row j
    is weighted by weights[j]), out fp32 [rows, H] (contiguous). The numbers of ``q4_expert(x, w13, w2,
    weights[j:j+1])``, without its tensor set-up or the copy into ``out`` (an offloaded layer's decode rows)."""
    _check_fp32("x", x)
    _check_fp32("out", out)
    if x.shape[0] != 1 or not (0 <= j < out.shape[0]) or weights.dtype != torch.float32 \
            or not weights.is_contiguous() or j >= weights.numel():
        raise ValueError(f"expert_row: x {tuple(x.shape)}, weights {weights.dtype} {tuple(weights.shape)}, "
                         f"row {j} of out {tuple(out.shape)}")
    _q4_expert_row(x, w13, w2, weights.data_ptr() + 4 * j, out.data_ptr() + 4 * out.shape[1] * j,
                   accumulate=False, what="expert_row")


def shared_expert_step(x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, gate: torch.Tensor | None) -> torch.Tensor:
    """A dense SwiGLU MLP (a shared expert) in one call: x fp32 [T, H] -> fp32 [T, H] =
    ``sigmoid(x @ gate) * (silu(x W_gate) * (x W_up)) W_down``; w13 [2I, H] (gate rows, then up rows), w2 [H, I]: q4
    matrices of one group size and form of scales; gate fp32 [H] (Qwen2-MoE's shared_expert_gate), or None (no
    output gate). The same call the one-call layers make (``mf_shared_expert``)."""
    _check_fp32("x", x)
    inter = w2.shape[1]
    if x.dim() != 2 or w13.shape != (2 * inter, x.shape[1]) or w2.shape[0] != x.shape[1] \
            or w13.group_size != w2.group_size or w13.fmt != w2.fmt:
        raise ValueError(f"shared_expert_step: x {tuple(x.shape)}, w13 {w13.shape} (group {w13.group_size}), w2 "
                         f"{w2.shape} (group {w2.group_size}): expected [T, H], [2I, H], [H, I] of one group and form")
    if gate is not None:
        _check_fp32("gate", gate)
        if gate.numel() != x.shape[1]:
            raise ValueError(f"shared_expert_step: gate {tuple(gate.shape)} for hidden size {x.shape[1]}")
    out = torch.empty_like(x)
    rc = _lib().mf_shared_expert(x.data_ptr(), x.shape[0], x.shape[1], inter, w13.group_size, w13.fmt,
                                 w13.packed.data_ptr(), w13.scales.data_ptr(), w13.mins.data_ptr(),
                                 w2.packed.data_ptr(), w2.scales.data_ptr(), w2.mins.data_ptr(),
                                 None if gate is None else gate.data_ptr(),
                                 out.data_ptr(), 0, torch.get_num_threads())
    if rc:
        raise MemoryError("shared_expert_step: the CPU kernel could not allocate its buffers")
    return out


def step_routing_and_caches(k: int, caches: Sequence[tuple[torch.Tensor, ...]], ids: torch.Tensor | None,
                            weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, ctypes.Array]:
    """A one-call step's routing outputs and cache pointers for n = len(caches) layers of top-``k`` routing:
    ``ids`` int32 [n, k] and ``weights`` fp32 [n, k] (the caller's, else new), and each layer's (k cache, v cache,
    mask) data pointers in order (3 n)."""
    n = len(caches)
    ids = torch.empty((n, k), dtype=torch.int32) if ids is None else ids
    weights = torch.empty((n, k), dtype=torch.float32) if weights is None else weights
    ptrs = (ctypes.c_void_p * (3 * n))(*[t.data_ptr() for c in caches for t in c])
    return ids, weights, ptrs


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x fp32 [T, H] @ weight fp32 [E, H].T -> fp32 [T, E] (a router's logits: a few dot products, no BLAS call)."""
    _check_fp32("x", x)
    _check_fp32("weight", weight)
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} for a weight {tuple(weight.shape)}")
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    _lib().mf_dense_f32(x.data_ptr(), x.shape[0], x.shape[1], weight.shape[0], weight.data_ptr(), y.data_ptr())
    return y


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moeflow.moe.routing.softmax_topk` in one call: logits fp32 [T, E] -> (probs fp32 [T, E],
    ids int32 [T, k] (largest first, the lower index first among equals), weights fp32 [T, k])."""
    _check_fp32("logits", logits)
    t, e = logits.shape
    probs = torch.empty_like(logits)
    ids = torch.empty((t, top_k), dtype=torch.int32)
    weights = torch.empty((t, top_k), dtype=torch.float32)
    _lib().mf_softmax_topk(logits.data_ptr(), t, e, top_k, int(renormalize), probs.data_ptr(), ids.data_ptr(),
                           weights.data_ptr())
    return probs, ids, weights


def block_linear_ok(layer: torch.nn.Module, bias: bool = False) -> bool:
    """Whether :func:`attention_block` takes ``layer`` as its qkv or o projection (qkv: also a
    :class:`~moeflow.kernels.cpu.quant_linear.SplitLinear` of two such layers, q's rows and k's and v's; ``bias``:
    a CpuQuantLinear's fp32 bias is allowed, the q/k/v projection's)."""
    if isinstance(layer, SplitLinear):
        return all(block_linear_ok(p) for p in layer.parts)
    kind = (isinstance(layer, CpuQuantLinear) and layer.native and layer.bits in (4, 8)) or (
        isinstance(layer, GGUFLinear) and layer.blocks.stride(1) == 1 and layer.blocks.stride(0) < 2**31)
    return kind and (layer.bias is None or (bias and layer.bias.dtype == torch.float32 and layer.bias.is_contiguous()))


def bias_arg(layer: torch.nn.Module) -> int | None:
    """The address of ``layer``'s fp32 bias (mf_attn_block's ``qkv_b``), or None."""
    return None if layer.bias is None else layer.bias.data_ptr()


def qkv_args(layer: CpuQuantLinear | SplitLinear) -> tuple:
    """mf_attn_block's 12 arguments for the q/k/v projection: one linear's, then (0, 0, 0, None, None, None); or a
    split one's q part, then its k/v part."""
    if isinstance(layer, SplitLinear):
        return (*_linear_args(layer.parts[0]), *_linear_args(layer.parts[1]))
    return (*_linear_args(layer), 0, 0, 0, None, None, None)


def _linear_args(layer: CpuQuantLinear | GGUFLinear) -> tuple:
    """(bits, group, fmt, weight, scales, mins) of a native layer: mf_attn_block's arguments for one linear (a
    GGUFLinear's: MF_LINEAR_GGUF, its row stride in bytes, its ggml type id, its blocks; step.h's mf_linear)."""
    if isinstance(layer, GGUFLinear):
        return LINEAR_GGUF, layer.blocks.stride(0), layer.type.type_id, layer.blocks.data_ptr(), None, None
    if layer.bits == 4:
        fmt = q4_fmt(layer.scales, layer.mins)
        return 4, layer.group_size, fmt, layer.packed.data_ptr(), layer.scales.data_ptr(), layer.mins.data_ptr()
    return 8, 0, Q4_F32, layer.int8_weight.data_ptr(), layer.int8_scales.data_ptr(), None


# ---- plain-torch fp32 models of the ops above ----

def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 model of :func:`rmsnorm`."""
    total = None if residual is None else x + residual
    h = x if total is None else total
    h = h * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True).float() + eps)
    return weight * h, total


def attention_step_reference(qkv: torch.Tensor, n_heads: int, n_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, cache_position: torch.Tensor,
                             mask: torch.Tensor, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """fp32 model of :func:`attention_step` (same arguments; writes the caches the same way)."""
    b, t, features = qkv.shape
    d = features // (n_heads + 2 * n_kv)
    if qk_norm is not None:
        q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
        if qk_norm.per_head:
            q = rmsnorm_reference(q.reshape(b, t, n_heads, d), qk_norm.q, qk_norm.eps)[0].reshape(b, t, -1)
            k = rmsnorm_reference(k.reshape(b, t, n_kv, d), qk_norm.k, qk_norm.eps)[0].reshape(b, t, -1)
        else:
            q, k = rmsnorm_reference(q, qk_norm.q, qk_norm.eps)[0], rmsnorm_reference(k, qk_norm.k, qk_norm.eps)[0]
        qkv = torch.cat((q, k, v), dim=-1)
    q, k, v = qkv.view(b, t, n_heads + 2 * n_kv, d).transpose(1, 2).split([n_heads, n_kv, n_kv], dim=1)

    def rotary(x: torch.Tensor) -> torch.Tensor:
        rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)
        return x * cos[:, None] + rot * sin[:, None]

    q, k = rotary(q), rotary(k)
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    groups = n_heads // n_kv
    keys, values = k_cache.repeat_interleave(groups, 1), v_cache.repeat_interleave(groups, 1)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ values).transpose(1, 2).reshape(b, t, n_heads * d)


def shared_expert_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            gate: torch.Tensor | None) -> torch.Tensor:
    """fp32 model of :func:`shared_expert_step` on dense weights: x [T, H], w13 [2I, H] (gate rows, then up), w2
    [H, I], gate [H] or None -> [T, H]: the expert's model weighted per token by ``sigmoid(x @ gate)``."""
    weights = torch.ones(x.shape[0]) if gate is None else torch.sigmoid(x @ gate)
    return q4_expert_reference(x, w13, w2, weights)


def softmax_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 model of :func:`softmax_topk` (and :func:`router_logits` is ``x @ weight.T``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return probs, ids.to(torch.int32), weights / weights.sum(-1, keepdim=True) if renormalize else weights
