"""A one-token CPU decode step through all decoder layers as one native call (``mf_layers_step``, step_region.c).

Per layer it runs, in C, exactly the calls the per-layer path makes from Python: the attention half
(``mf_attn_block``, :func:`~moeflow.kernels.cpu.step.attention_block`), the router logits and the softmax top-k
(``mf_dense_f32``, ``mf_softmax_topk``), the k experts accumulated in k order (``mf_q4_expert``,
:func:`~moeflow.kernels.cpu.step.experts_step`; or ``mf_gguf_expert`` for GGUF experts read as stored, the calls
:class:`~moeflow.kernels.cpu.gguf.GGUFCpuExpert` makes, their rows summed in k order as the combine does) and the
residual add (one fp32 add, as ``x + moe``): the same numbers, bit for bit, without ~150 Python calls and ~15
tensor allocations per layer (~1 ms per token on the peer benchmark's 8-layer model, issue 21). The layers are
described once (:class:`LayerDesc`, pointers into the model's own weight tensors, which must stay where they are);
each step passes the caches, the masks and the token. The call is one OpenMP parallel region of torch's thread
count for all the layers (each output the same bits at any count), GGUF experts included (gguf.c's
``mf_gguf_expert_team``); only GGUF experts beside a shared expert run the calls one by one
(``mf_layers_step_calls``, step.c), each kernel with its own region.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from moeflow.kernels.cpu.gguf import GGUFCpuExpert, GGUFLinear
from moeflow.kernels.cpu.lm_head import RefinedInt4LmHead
from moeflow.kernels.cpu.native import declared
from moeflow.kernels.cpu.q4_matrix import Q4Matrix
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear
from moeflow.kernels.cpu.step import (
    QKNorm,
    _check_fp32,
    _lib,
    _linear_args,
    bias_arg,
    block_linear_ok,
    qk_norm_args,
    qkv_args,
    step_routing_and_caches,
)

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
MAX_CANDIDATES = 64  # step.h's MF_MAX_CANDIDATES: a refined int4 head's recomputed logits, at most


class ExpertDesc(ctypes.Structure):
    """step.c's ``mf_expert_desc``: one expert's q4 matrices (w13 [2I, H], w2 [H, I]; ``t13`` 0), or its GGUF
    blocks (``t13``, ``t2`` ggml type ids; gate in w13, up, down in w2, row strides gs13, gs2 in bytes)."""

    _fields_ = [*((n, _p) for n in ("w13", "s13", "m13", "w2", "s2", "m2")), ("fmt", _i), ("t13", _i), ("t2", _i),
                ("gs13", ctypes.c_int64), ("gs2", ctypes.c_int64), ("up", _p)]


def _q4_desc(w13: Q4Matrix, w2: Q4Matrix) -> ExpertDesc:
    return ExpertDesc(w13.packed.data_ptr(), w13.scales.data_ptr(), w13.mins.data_ptr(), w2.packed.data_ptr(),
                      w2.scales.data_ptr(), w2.mins.data_ptr(), w13.fmt)


def _gguf_desc(e: GGUFCpuExpert) -> ExpertDesc:
    return ExpertDesc(e.gate.data_ptr(), None, None, e.down.data_ptr(), None, None, 0, e.gate_up_type.type_id,
                      e.down_type.type_id, e.gate.stride(0), e.down.stride(0), e.up.data_ptr())


def _expert_table(experts: Sequence[tuple[Q4Matrix, Q4Matrix] | GGUFCpuExpert], h: int) -> tuple[ctypes.Array,
                                                                                                      int, int]:
    """(the experts' ExpertDesc array, intermediate size, q4 group size or 0) after checking they fit hidden size
    ``h``: all q4 (one shape, group size and form of scales per expert) or all GGUF (one shape)."""
    if all(isinstance(e, GGUFCpuExpert) for e in experts):
        if len({(e.hidden_size, e.intermediate_size) for e in experts}) != 1 or experts[0].hidden_size != h:
            raise ValueError(f"layer_desc: GGUF experts of one shape with hidden size {h} expected")
        return (ExpertDesc * len(experts))(*map(_gguf_desc, experts)), experts[0].intermediate_size, 0
    if any(isinstance(e, GGUFCpuExpert) for e in experts) or \
            len({(w13.shape, w2.shape, w13.group_size, w2.group_size) for w13, w2 in experts}) != 1:
        raise ValueError("layer_desc: the experts must be all GGUF or all q4 of one shape and group size")
    w13, w2 = experts[0]
    inter = w2.shape[1]
    if w13.shape != (2 * inter, h) or w2.shape != (h, inter) or w13.group_size != w2.group_size:
        raise ValueError(f"layer_desc: experts w13 {w13.shape}, w2 {w2.shape} for hidden size {h}")
    if any(a.fmt != b.fmt for a, b in experts):
        raise ValueError("layer_desc: an expert's w13 and w2 must share one form of scales (Q4Matrix.fmt)")
    return (ExpertDesc * len(experts))(*[_q4_desc(a, b) for a, b in experts]), inter, w13.group_size


class LayerDesc(ctypes.Structure):
    """step.c's ``mf_layer_desc``: one Mixtral-layout layer (attention half with its QK-norm if any, softmax-top-k
    router, experts)."""

    _fields_ = [("w_in", _p), ("w_post", _p), ("eps", _f), ("qkv_bits", _i), ("qkv_group", _i), ("qkv_fmt", _i),
                ("qkv_w", _p), ("qkv_s", _p), ("qkv_m", _p), ("kv_bits", _i), ("kv_group", _i), ("kv_fmt", _i),
                ("kv_w", _p), ("kv_s", _p), ("kv_m", _p), ("o_bits", _i), ("o_group", _i), ("o_fmt", _i),
                ("o_w", _p), ("o_s", _p), ("o_m", _p), ("nh", _i), ("nkv", _i), ("D", _i), ("qkv_b", _p), ("qk", _i),
                ("qn", _p), ("kn", _p), ("qk_eps", _f), ("gate", _p), ("E", _i),
                ("k", _i), ("renorm", _i), ("I", _i), ("group", _i), ("experts", ctypes.POINTER(ExpertDesc)),
                ("shared", ctypes.POINTER(ExpertDesc)), ("shared_gate", _p), ("shared_I", _i), ("shared_group", _i)]


class LinearDesc(ctypes.Structure):
    """step.h's ``mf_linear``: an int8 or int4 matrix of ``n`` rows (bits, group, fmt, weight, scales, mins)."""

    _fields_ = [("bits", _i), ("group", _i), ("fmt", _i), ("n", _i), ("w", _p), ("s", _p), ("m", _p)]


class HeadDesc(ctypes.Structure):
    """step.h's ``mf_head_desc``: the final RMSNorm (weight fp32 [H], eps) and an lm_head [V, H]: a native int8 or
    int4 matrix (``head``), or a GGUF file's blocks (``gguf_type`` the ggml type id, ``head.w`` the blocks, rows
    ``stride`` bytes apart)."""

    _fields_ = [("norm", _p), ("eps", _f), ("head", LinearDesc), ("gguf_type", _i), ("stride", ctypes.c_int64),
                ("candidates", _i), ("exact", LinearDesc)]


def _signatures(lib: ctypes.CDLL) -> None:
    lib.mf_layers_step.argtypes = [ctypes.POINTER(LayerDesc), _i, _p, _i, _p, _p, _p, _i, _p, _f, _p, _p, _i]
    lib.mf_layers_step.restype = _i
    lib.mf_decode_step.argtypes = [ctypes.POINTER(LayerDesc), _i, _p, _i, _p, _p, _p, _i, _p, _f, _p, _p,
                                   ctypes.POINTER(HeadDesc), _p, _i]
    lib.mf_decode_step.restype = _i


def head_ok(norm_weight: torch.Tensor, lm_head: torch.nn.Module) -> bool:
    """Whether :func:`head_desc` takes this final norm's weight and lm_head: a native int8 or int4
    CpuQuantLinear, a GGUFLinear (a file's K-quant or Q8_0 head on its blocks) or a RefinedInt4LmHead (its int4 logits,
    then its candidates recomputed in int8: ``mf_head_refine``, its forward's numbers at one token; ties at the
    last candidate to the lower index), without bias, over a contiguous fp32 norm weight of its input size."""
    head = (isinstance(lm_head, CpuQuantLinear) and block_linear_ok(lm_head)) or \
        (isinstance(lm_head, GGUFLinear) and lm_head.bias is None) or \
        (isinstance(lm_head, RefinedInt4LmHead) and block_linear_ok(lm_head.int4) and block_linear_ok(lm_head.int8)
         and lm_head.candidates <= MAX_CANDIDATES)
    return head and norm_weight.dtype == torch.float32 and norm_weight.is_contiguous() \
        and norm_weight.numel() == lm_head.in_features


def head_desc(norm_weight: torch.Tensor, eps: float, lm_head: CpuQuantLinear | GGUFLinear) -> HeadDesc:
    """The tail's descriptor: the final norm (weight fp32 [H]) and lm_head (``head_ok``), pointers into their
    tensors (which must stay where they are)."""
    if not head_ok(norm_weight, lm_head):
        raise ValueError("head_desc: expected a native int8/int4 CpuQuantLinear or a GGUFLinear lm_head without "
                         "bias and its final norm's fp32 weight of in_features values")
    if isinstance(lm_head, RefinedInt4LmHead):
        int4, int8 = (LinearDesc(*_linear_args(m)[:3], lm_head.out_features, *_linear_args(m)[3:])
                      for m in (lm_head.int4, lm_head.int8))
        return HeadDesc(norm_weight.data_ptr(), eps, int4, 0, 0, lm_head.candidates, int8)
    if isinstance(lm_head, GGUFLinear):
        return HeadDesc(norm_weight.data_ptr(), eps, LinearDesc(0, 0, 0, lm_head.out_features,
                                                                lm_head.blocks.data_ptr()),
                        lm_head.type.type_id, lm_head.blocks.stride(0))
    bits, group, fmt, w, s, m = _linear_args(lm_head)
    return HeadDesc(norm_weight.data_ptr(), eps, LinearDesc(bits, group, fmt, lm_head.out_features, w, s, m))


def check_logits(head: HeadDesc, logits: torch.Tensor | None, caller: str) -> None:
    """Raise unless ``logits`` is a contiguous fp32 tensor of the head's ``head.n`` values (the tail's output)."""
    if logits is None or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.numel() != head.head.n:
        raise ValueError(f"{caller}: logits must be a contiguous fp32 tensor of {head.head.n} values")


def layer_desc(norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float, qkv: torch.nn.Module,
               o: torch.nn.Module, n_heads: int, n_kv: int, head_dim: int, gate: torch.Tensor, top_k: int,
               renormalize: bool, experts: Sequence[tuple[Q4Matrix, Q4Matrix] | GGUFCpuExpert],
               qk_norm: QKNorm | None = None,
               shared: tuple[Q4Matrix, Q4Matrix, torch.Tensor | None] | None = None) -> tuple[LayerDesc, object]:
    """One layer's descriptor: norms fp32 [H]; ``qkv``, ``o``: native int4/int8 CpuQuantLinear (no bias; ``qkv``
    also a SplitLinear of two);
    gate fp32 [E, H] (contiguous); experts: E (w13 [2I, H], w2 [H, I]) q4 pairs of one group size, or E GGUF
    experts (gate/up [I, H], down [H, I] blocks, their types per expert: Q4_K_M mixes them); ``qk_norm``: the
    attention's QK-norm (Qwen3-MoE, OLMoE), if any (its weights must stay where they are too); ``shared``: a shared
    expert (w13 [2I, H] gate then up rows, w2 [H, I], its sigmoid output gate fp32 [H] or None), added to the
    experts' sum as MoEBlock does (``mf_shared_expert``, the call its per-layer step makes). Returns the
    descriptor and what it points into (the expert array and the experts: keep both alive together)."""
    if not (block_linear_ok(qkv, bias=True) and block_linear_ok(o)):
        raise ValueError("layer_desc: q/k/v and o must be native int4/int8 CpuQuantLinear layers (o without bias)")
    for name, t in (("norm_in", norm_in), ("norm_post", norm_post), ("gate", gate)):
        _check_fp32(name, t)
    if len(experts) != gate.shape[0]:
        raise ValueError(f"layer_desc: {len(experts)} experts for a gate {tuple(gate.shape)}")
    table, inter, group = _expert_table(experts, gate.shape[1])
    if qk_norm is not None:
        qk_norm.check(n_heads, n_kv, head_dim)
    shared_table, shared_args = None, (None, None, 0, 0)
    if shared is not None:
        w13, w2, shared_gate = shared
        s_inter, h = w2.shape[1], gate.shape[1]
        if w13.shape != (2 * s_inter, h) or w2.shape != (h, s_inter) or w13.group_size != w2.group_size \
                or w13.fmt != w2.fmt or (shared_gate is not None and shared_gate.numel() != h):
            raise ValueError(f"layer_desc: shared expert w13 {w13.shape}, w2 {w2.shape} for hidden size {h}")
        if shared_gate is not None:
            _check_fp32("shared_gate", shared_gate)
        shared_table = (ExpertDesc * 1)(_q4_desc(w13, w2))
        shared_args = (shared_table, None if shared_gate is None else shared_gate.data_ptr(), s_inter,
                       w13.group_size)
    desc = LayerDesc(norm_in.data_ptr(), norm_post.data_ptr(), eps, *qkv_args(qkv), *_linear_args(o), n_heads,
                     n_kv, head_dim, bias_arg(qkv), *qk_norm_args(qk_norm), gate.data_ptr(), gate.shape[0], top_k,
                     int(renormalize), inter, group, table, *shared_args)
    # the experts too: the tables hold their tensors' addresses
    return desc, (table, list(experts), shared_table, shared)


def layers_step(descs: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                caches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cache_position: torch.Tensor,
                ids: torch.Tensor | None = None, weights: torch.Tensor | None = None, head: HeadDesc | None = None,
                logits: torch.Tensor | None = None) -> torch.Tensor:
    """One token through the described layers: x fp32 [1, 1, H] -> fp32 [1, 1, H] (x is not changed).

    cos, sin fp32 [1, 1, D]; caches: per layer (k cache, v cache fp32 [1, n_kv, L, D], mask bool [1, 1, 1, L]),
    each contiguous and written at ``cache_position`` (int64 [1]); ``ids`` int32 [n, k] / ``weights`` fp32
    [n, k] (optional) receive each layer's routing. The caller checks shapes (as attention_block does).
    ``head`` (:func:`head_desc`): then, in the same parallel region (``mf_decode_step``), the final norm and the
    lm_head of the result into ``logits`` fp32 [1, 1, V] (contiguous): ``lm_head(norm(result))``'s numbers, bit
    for bit (the per-call kernels': mf_rmsnorm, then mf_q8_linear / mf_q4_linear / mf_gguf_linear)."""
    n = len(descs)
    out = x.clone()
    k = max(d.k for d in descs)
    ids, weights, ptrs = step_routing_and_caches(k, caches, ids, weights)
    k_cache = caches[0][0]
    lib = declared(_lib(), _signatures)
    args = (descs, n, out.data_ptr(), x.shape[-1], cos.data_ptr(), sin.data_ptr(), ptrs, k_cache.shape[2],
            cache_position.data_ptr(), 1.0 / math.sqrt(k_cache.shape[3]), ids.data_ptr(), weights.data_ptr())
    if head is None:
        rc = lib.mf_layers_step(*args, torch.get_num_threads())
    else:
        check_logits(head, logits, "layers_step")
        rc = lib.mf_decode_step(*args, ctypes.byref(head), logits.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("layers_step: the CPU kernel could not allocate its buffers")
    if rc:
        raise ValueError(f"layers_step: the CPU kernel refused a GGUF expert's type or size, or the head (code {rc})")
    return out
