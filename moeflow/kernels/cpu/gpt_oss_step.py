"""gpt-oss's one-token CPU decode step through every decoder layer as one native call (``mf_gptoss_step``,
step_gptoss.c; issue 42).

Per layer, in one OpenMP parallel region for all the layers: the input norm, the biased q/k/v projections (int8 /
int4 :class:`~moeflow.kernels.cpu.quant_linear.CpuQuantLinear` on moeflow's kernels, or a GGUF file's blocks in a
:class:`~moeflow.kernels.cpu.gguf.GGUFLinear`: the per-layer path's kernels, bit for bit), rotary and the cache
write, attention with the head's sink over the layer's mask (its sliding window), the biased o projection and the
residual add, the post-attention norm, the biased router (top-k logits, their softmax), the k MXFP4 experts on the
pool's region bytes (``mxfp4.c``'s rows and epilogue, the per-layer path's numbers bit for bit) summed in k order
(the combine's), the residual add. The norms, the attention and the router run in C where the per-layer path runs
torch: the same formulas in another summation order (tests/test_gpt_oss_step.py: logits within tolerance, the
greedy tokens equal, the same bits at any thread count).

The layers are described once (:func:`gpt_oss_layer_desc`: pointers into the model's weights and the expert pool,
which must stay where they are); each step passes the caches, the masks and the token. With a ``head``
(:func:`~moeflow.kernels.cpu.layers.head_desc`), the step also runs the tail in the same region
(``mf_gptoss_decode_step``: the final norm and the lm_head, step_head.c's code, which the Mixtral-style step runs
too): the per-call ``lm_head(norm(x))``'s logits bit for bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.layers import HeadDesc, check_logits
from moeflow.kernels.cpu.native import check_rc, declared
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear
from moeflow.kernels.cpu.step import _check_fp32, _lib, _linear_args, step_routing_and_caches

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
GGUF_TYPES = {2: 32, 8: 32, 12: 256, 13: 256, 14: 256}  # ggml type ids gguf.c computes (Q4_0, Q8_0, Q4/5/6_K): block


class ProjDesc(ctypes.Structure):
    """step_gptoss.c's ``mf_proj``: one attention projection (bits 8 / 4: native rows; 0: GGUF blocks of ``type``,
    rows ``stride`` bytes apart) and its fp32 bias or None."""

    _fields_ = [("bits", _i), ("group", _i), ("fmt", _i), ("type", _i), ("stride", ctypes.c_int64), ("w", _p),
                ("s", _p), ("m", _p), ("b", _p)]


class MxExpertDesc(ctypes.Structure):
    """step_gptoss.c's ``mf_mx_expert``: one expert's region addresses (w13 blocks, scales, w2 blocks, scales, the
    biases or None)."""

    _fields_ = [(n, _p) for n in ("b13", "s13", "b2", "s2", "c13", "c2")]


class GptOssLayerDesc(ctypes.Structure):
    """step_gptoss.c's ``mf_gptoss_layer``."""

    _fields_ = [("w_in", _p), ("w_post", _p), ("eps", _f), ("pq", ProjDesc), ("pk", ProjDesc), ("pv", ProjDesc),
                ("po", ProjDesc), ("nh", _i), ("nkv", _i), ("D", _i), ("sinks", _p), ("gate", _p), ("gate_b", _p),
                ("E", _i), ("k", _i), ("I", _i), ("p13", _i), ("p2", _i), ("bias_kind", _i), ("act", _i),
                ("alpha", _f), ("limit", _f), ("experts", ctypes.POINTER(MxExpertDesc))]


def _signatures(lib: ctypes.CDLL) -> None:
    lib.mf_gptoss_step.argtypes = [ctypes.POINTER(GptOssLayerDesc), _i, _p, _i, _p, _p, _p, _i, _p, _f, _p, _p, _i]
    lib.mf_gptoss_step.restype = _i
    lib.mf_gptoss_decode_step.argtypes = [ctypes.POINTER(GptOssLayerDesc), _i, _p, _i, _p, _p, _p, _i, _p, _f, _p,
                                          _p, ctypes.POINTER(HeadDesc), _p, _i]
    lib.mf_gptoss_decode_step.restype = _i


def proj_desc(layer: torch.nn.Module) -> ProjDesc | None:
    """``layer``'s descriptor when the step computes it with the per-layer path's kernel: a native int8 / int4
    :class:`CpuQuantLinear` or a :class:`GGUFLinear` of a type gguf.c computes, its bias (if any) fp32 contiguous;
    else None."""
    bias = getattr(layer, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    b = None if bias is None else bias.data_ptr()
    if isinstance(layer, CpuQuantLinear) and layer.native and layer.bits in (4, 8):
        bits, group, fmt, w, s, m = _linear_args(layer)
        return ProjDesc(bits, group, fmt, 0, 0, w, s, m, b)
    if isinstance(layer, GGUFLinear) and layer.type.type_id in GGUF_TYPES \
            and layer.in_features % GGUF_TYPES[layer.type.type_id] == 0 and layer.blocks.stride(1) == 1:
        return ProjDesc(0, 0, 0, layer.type.type_id, layer.blocks.stride(0), layer.blocks.data_ptr(), None, None, b)
    return None


def gpt_oss_layer_desc(norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float,
                       projections: Sequence[ProjDesc], n_heads: int, n_kv: int, head_dim: int, sinks: torch.Tensor,
                       gate: torch.Tensor, gate_bias: torch.Tensor | None, top_k: int,
                       experts: Sequence[MxExpertDesc], inter: int, panels: tuple[int, int], bias_kind: int,
                       activation: int, alpha: float, limit: float) -> tuple[GptOssLayerDesc, ctypes.Array]:
    """One layer's descriptor: norms fp32 [H]; ``projections``: q, k, v, o (:func:`proj_desc`); sinks fp32 [nh];
    router gate fp32 [E, H] and its bias fp32 [E] (or None); ``experts``: E region descriptors of intermediate size
    ``inter``, their w13 / w2 panels, biases of ``bias_kind`` (mxfp4.c's MX_BIAS_*), ``activation`` (MX_SILU /
    MX_SWIGLU) with alpha and limit. Returns the descriptor and the expert array it points into (keep both alive
    with the weights and the pool)."""
    for name, t in (("norm_in", norm_in), ("norm_post", norm_post), ("gate", gate), ("sinks", sinks)):
        _check_fp32(name, t)
    if gate_bias is not None:
        _check_fp32("gate_bias", gate_bias)
    if len(experts) != gate.shape[0] or sinks.numel() != n_heads or n_heads % n_kv:
        raise ValueError(f"gpt_oss_layer_desc: {len(experts)} experts for a gate {tuple(gate.shape)}, "
                         f"{sinks.numel()} sinks for {n_heads} heads ({n_kv} kv heads)")
    table = (MxExpertDesc * len(experts))(*experts)
    q, k, v, o = projections
    desc = GptOssLayerDesc(norm_in.data_ptr(), norm_post.data_ptr(), eps, q, k, v, o, n_heads, n_kv, head_dim,
                           sinks.data_ptr(), gate.data_ptr(), None if gate_bias is None else gate_bias.data_ptr(),
                           gate.shape[0], top_k, inter, panels[0], panels[1], bias_kind, activation, alpha, limit,
                           table)
    return desc, table


def gpt_oss_step(descs: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 caches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cache_position: torch.Tensor,
                 scale: float, ids: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                 head: HeadDesc | None = None, logits: torch.Tensor | None = None) -> torch.Tensor:
    """One token through the described layers: x fp32 [1, 1, H] -> fp32 [1, 1, H] (x is not changed).

    cos, sin fp32 [1, 1, D]; caches: per layer (k cache, v cache fp32 [1, n_kv, L, D], mask bool [1, 1, 1, L]: the
    layer's, its sliding window included), each contiguous and written at ``cache_position`` (int64 [1]);
    ``scale``: the attention scores' factor; ``ids`` int32 [n, k] / ``weights`` fp32 [n, k] (optional) receive
    each layer's routing. The caller checks shapes. ``head``: then, in the same parallel region, the final norm and
    the lm_head of the result into ``logits`` fp32 [1, 1, V] (contiguous), ``lm_head(norm(result))``'s numbers bit
    for bit (the per-call kernels': mf_rmsnorm, then mf_q8_linear / mf_q4_linear / mf_gguf_linear)."""
    n = len(descs)
    out = x.clone()
    k = max(d.k for d in descs)
    ids, weights, ptrs = step_routing_and_caches(k, caches, ids, weights)
    lib = declared(_lib(), _signatures)
    args = (descs, n, out.data_ptr(), x.shape[-1], cos.data_ptr(), sin.data_ptr(), ptrs, caches[0][0].shape[2],
            cache_position.data_ptr(), scale, ids.data_ptr(), weights.data_ptr())
    if head is None:
        check_rc(lib.mf_gptoss_step(*args, torch.get_num_threads()), "gpt_oss_step")
    else:
        check_logits(head, logits, "gpt_oss_step")
        check_rc(lib.mf_gptoss_decode_step(*args, ctypes.byref(head), logits.data_ptr(), torch.get_num_threads()),
                 "gpt_oss_step")
    return out


# ---- the per-layer path's ops: the step's own attention and routing, one call each ----

def _signatures_ops(lib: ctypes.CDLL) -> None:
    lib.mf_sink_attn_step.argtypes = [_p, _p, _p, _i, _i, _i, _p, _p, _p, _p, _i, ctypes.c_int64, _p, _f, _p, _p, _i]
    lib.mf_sink_attn_step.restype = _i
    lib.mf_topk_softmax.argtypes = [_p, _i, _i, _i, _p, _p]
    lib.mf_topk_softmax.restype = None


def sink_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv: int,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        position: int, mask: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's sink attention as the one-call step computes it: q fp32 [nh D], k, v fp32 [nkv D] (projected,
    before the rotary), cos, sin fp32 [D]; the rotated key and the value written at ``position`` of k_cache,
    v_cache fp32 [1, nkv, L, D]; mask bool [L] (the layer's, its sliding window included); sinks fp32 [nh] ->
    out fp32 [nh D]. All contiguous (the caller checks)."""
    out = torch.empty(q.numel(), dtype=torch.float32)
    lib = declared(_lib(), _signatures_ops)
    check_rc(lib.mf_sink_attn_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), n_heads, n_kv, q.numel() // n_heads,
                                   cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   k_cache.shape[2], position, mask.data_ptr(), scale, sinks.data_ptr(),
                                   out.data_ptr(), torch.get_num_threads()), "sink_attention_step")
    return out


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moeflow.moe.routing.topk_then_softmax` as the one-call step routes: logits fp32 [T, E] (contiguous)
    -> (probs fp32 [T, E] (torch's softmax over every expert, for statistics), ids int32 [T, k] (largest first,
    the lower index first among equals), weights fp32 [T, k])."""
    _check_fp32("logits", logits)
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int32)
    weights = torch.empty((t, top_k), dtype=torch.float32)
    declared(_lib(), _signatures_ops).mf_topk_softmax(logits.data_ptr(), t, e, top_k, ids.data_ptr(),
                                                      weights.data_ptr())
    return torch.softmax(logits, dim=-1, dtype=torch.float32), ids, weights
