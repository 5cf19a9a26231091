"""A one-token CPU decode step through all decoder layers as one native call (``mf_layers_step``, step.c).

Per layer it runs, in C, exactly the calls the per-layer path makes from Python: the attention half
(``mf_attn_block``, :func:`~moeflow.kernels.cpu.step.attention_block`), the router logits and the softmax
top-k (``mf_dense_f32``, ``mf_softmax_topk``), the k experts accumulated in k order (``mf_q4_expert``,
:func:`~moeflow.kernels.cpu.step.experts_step`) and the residual add (one fp32 add, as ``x + moe``): the same
numbers, bit for bit, without ~150 Python calls and ~15 tensor allocations per layer (~1 ms per token on the
peer benchmark's 8-layer model, issue 21). The layers are described once (:class:`LayerDesc`, pointers into the
model's own weight tensors, which must stay where they are); each step passes the caches, the masks and the
token.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from moeflow.kernels.cpu.native import Q4Matrix
from moeflow.kernels.cpu.step import _check_fp32, _lib, _linear_args, block_linear_ok, qkv_args

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class ExpertDesc(ctypes.Structure):
    """step.c's ``mf_expert_desc``: one expert's q4 matrices (w13 [2I, H], w2 [H, I])."""

    _fields_ = [*((n, _p) for n in ("w13", "s13", "m13", "w2", "s2", "m2")), ("fmt", _i)]


class LayerDesc(ctypes.Structure):
    """step.c's ``mf_layer_desc``: one Mixtral-layout layer (attention half, softmax-top-k router, experts)."""

    _fields_ = [("w_in", _p), ("w_post", _p), ("eps", _f), ("qkv_bits", _i), ("qkv_group", _i), ("qkv_fmt", _i),
                ("qkv_w", _p), ("qkv_s", _p), ("qkv_m", _p), ("kv_bits", _i), ("kv_group", _i), ("kv_fmt", _i),
                ("kv_w", _p), ("kv_s", _p), ("kv_m", _p), ("o_bits", _i), ("o_group", _i), ("o_fmt", _i),
                ("o_w", _p), ("o_s", _p), ("o_m", _p), ("nh", _i), ("nkv", _i), ("D", _i), ("gate", _p), ("E", _i),
                ("k", _i), ("renorm", _i), ("I", _i), ("group", _i), ("experts", ctypes.POINTER(ExpertDesc))]


_DECLARED: set[int] = set()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with mf_layers_step's signature declared (once per loaded library)."""
    if id(lib) not in _DECLARED:
        lib.mf_layers_step.argtypes = [ctypes.POINTER(LayerDesc), _i, _p, _i, _p, _p, _p, _i, _p, _f, _p, _p, _i]
        lib.mf_layers_step.restype = _i
        _DECLARED.add(id(lib))
    return lib


def layer_desc(norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float, qkv: torch.nn.Module,
               o: torch.nn.Module, n_heads: int, n_kv: int, head_dim: int, gate: torch.Tensor, top_k: int,
               renormalize: bool, experts: Sequence[tuple[Q4Matrix, Q4Matrix]]) -> tuple[LayerDesc, object]:
    """One layer's descriptor: norms fp32 [H]; ``qkv``, ``o``: native int4/int8 CpuQuantLinear (no bias; ``qkv``
    also a SplitLinear of two);
    gate fp32 [E, H] (contiguous); experts: E (w13 [2I, H], w2 [H, I]) pairs of one group size. Returns the
    descriptor and the expert array it points into (keep both alive together)."""
    if not (block_linear_ok(qkv) and block_linear_ok(o)):
        raise ValueError("layer_desc: q/k/v and o must be native int4/int8 CpuQuantLinear layers without bias")
    for name, t in (("norm_in", norm_in), ("norm_post", norm_post), ("gate", gate)):
        _check_fp32(name, t)
    h = gate.shape[1]
    if len(experts) != gate.shape[0] or len({(w13.shape, w2.shape, w13.group_size, w2.group_size)
                                             for w13, w2 in experts}) != 1:
        raise ValueError(f"layer_desc: {len(experts)} experts of one shape and group size expected for a gate "
                         f"{tuple(gate.shape)}")
    w13, w2 = experts[0]
    inter = w2.shape[1]
    if w13.shape != (2 * inter, h) or w2.shape != (h, inter) or w13.group_size != w2.group_size:
        raise ValueError(f"layer_desc: experts w13 {w13.shape}, w2 {w2.shape} for hidden size {h}")
    if any(a.fmt != b.fmt for a, b in experts):
        raise ValueError("layer_desc: an expert's w13 and w2 must share one form of scales (Q4Matrix.fmt)")
    table = (ExpertDesc * len(experts))(*[
        ExpertDesc(a.packed.data_ptr(), a.scales.data_ptr(), a.mins.data_ptr(), b.packed.data_ptr(),
                   b.scales.data_ptr(), b.mins.data_ptr(), a.fmt) for a, b in experts])
    desc = LayerDesc(norm_in.data_ptr(), norm_post.data_ptr(), eps, *qkv_args(qkv), *_linear_args(o), n_heads,
                     n_kv, head_dim, gate.data_ptr(), gate.shape[0], top_k, int(renormalize), inter, w13.group_size,
                     table)
    return desc, table


def layers_step(descs: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                caches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cache_position: torch.Tensor,
                ids: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """One token through the described layers: x fp32 [1, 1, H] -> fp32 [1, 1, H] (x is not changed).

    cos, sin fp32 [1, 1, D]; caches: per layer (k cache, v cache fp32 [1, n_kv, L, D], mask bool [1, 1, 1, L]),
    each contiguous and written at ``cache_position`` (int64 [1]); ``ids`` int32 [n, k] / ``weights`` fp32
    [n, k] (optional) receive each layer's routing. The caller checks shapes (as attention_block does)."""
    n = len(descs)
    out = x.clone()
    k = max(d.k for d in descs)
    ids = torch.empty((n, k), dtype=torch.int32) if ids is None else ids
    weights = torch.empty((n, k), dtype=torch.float32) if weights is None else weights
    ptrs = (_p * (3 * n))(*[t.data_ptr() for c in caches for t in c])
    k_cache = caches[0][0]
    rc = _declare(_lib()).mf_layers_step(descs, n, out.data_ptr(), x.shape[-1], cos.data_ptr(), sin.data_ptr(),
                                         ptrs, k_cache.shape[2], cache_position.data_ptr(),
                                         1.0 / math.sqrt(k_cache.shape[3]), ids.data_ptr(), weights.data_ptr(),
                                         torch.get_num_threads())
    if rc:
        raise MemoryError("layers_step: the CPU kernel could not allocate its buffers")
    return out
