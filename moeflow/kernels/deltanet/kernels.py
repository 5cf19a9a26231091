"""Triton kernels of the Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE): the math of
:mod:`moeflow.families.gated_deltanet`, whose torch functions are the fp32 references.

* :func:`conv_decode`: the causal depthwise conv + SiLU of one decode token, the conv state shifted in place
  (a masked row keeps its state: nothing is stored). One program per (row, block of channels).
* :func:`recurrent`: the delta rule token by token, with the gates (``g``, ``beta`` from ``a``/``b``), the L2 norm
  of q/k and the query scale fused. One program per (row, value head, block of ``BLOCK_V`` values) keeps its
  state slice ``[dk, BLOCK_V]`` in registers: the fp32 state is read once and written once per launch, however
  many tokens. A masked token leaves the slice bitwise as it was (``tl.where``, not ``x * 1 + 0``).
  The same kernel runs prefill (the conv before it in torch): one launch a layer however long the prompt, no
  host loop over chunks. A chunked form with fp32 ``tl.dot`` (the loop over 64-token chunks of
  :func:`~moeflow.families.gated_deltanet.chunk_gated_delta_rule` in one kernel, the chunks' triangular solves
  in batched torch) was built and dropped: its [64, 128] fp32 operands spilled at every tile tried on sm_90 (255
  registers and 300-9600 spilled bytes, ``ieee``, ``tf32x3`` and even ``tf32``).

Every launch allocates only outputs of host-known shapes and reads nothing back: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton_common import cdiv, next_pow2, rounded

BLOCK_V = 8  # values per program: [128, 8] fp32 = 32 registers a thread in one warp (no cross-warp sums)
WARPS = 1
CONV_BLOCK = 256


@triton.jit
def _conv_decode_kernel(
    x_ptr, s_xb,  # [B, C] the token's conv input (model dtype)
    st_ptr, s_stb, s_stk,  # [B, KW-1, C] conv state, updated in place
    w_ptr,  # [C, KW] depthwise weights
    mask_ptr, s_mb,  # uint8 [B] the token is real
    o_ptr, s_ob,  # [B, C] silu(conv)
    C, KW: tl.constexpr, BKW: tl.constexpr, BC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cs < C
    js = tl.arange(0, BKW)
    from_state = (js < KW - 1)[:, None] & c_ok[None, :]
    win = tl.load(st_ptr + row * s_stb + js[:, None] * s_stk + cs[None, :], mask=from_state, other=0.0)
    x = tl.load(x_ptr + row * s_xb + cs, mask=c_ok, other=0.0)
    win = tl.where((js == KW - 1)[:, None], x.to(win.dtype)[None, :], win)  # the window: state then the token
    w = tl.load(w_ptr + cs[None, :] * KW + js[:, None], mask=(js < KW)[:, None] & c_ok[None, :], other=0.0)
    y = tl.sum(win.to(tl.float32) * w.to(tl.float32), axis=0)
    y = rounded(y, w_ptr.dtype.element_ty)  # the conv's output dtype, then SiLU on it (as F.silu)
    y = rounded(y / (1.0 + tl.exp(-y)), o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * s_ob + cs, y.to(o_ptr.dtype.element_ty), mask=c_ok)
    if tl.load(mask_ptr + row * s_mb) != 0:  # a real token: window rows 1.. become the state
        keep = (js >= 1)[:, None] & (js < KW)[:, None] & c_ok[None, :]
        tl.store(st_ptr + row * s_stb + (js - 1)[:, None] * s_stk + cs[None, :], win.to(st_ptr.dtype.element_ty),
                 mask=keep)


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), log1p kept accurate for small exp(x)."""
    e = tl.exp(tl.minimum(x, 20.0))
    log1p = tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _recurrent_kernel(
    qkv_ptr, s_qb, s_qt, s_qc,  # [B, T, 2 KEY_DIM + HV DV]: q, k (KEY_DIM each, by key head), v (by value head)
    a_ptr, b_ptr, s_ab, s_at, s_ah,  # [B, T, HV] pre-activation gates (a and b share strides)
    alog_ptr, dtb_ptr,  # [HV] A_log, dt_bias
    mask_ptr, s_mb, s_mt,  # uint8 [B, T]
    st_ptr, s_sb, s_sh, s_sk,  # fp32 [B, HV, DK, DV] updated in place
    o_ptr, s_ob, s_ot, s_oh,  # [B, T, HV, DV]
    T, scale,
    HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // HV).to(tl.int64)
    h = pid % HV
    hk = h // R  # each key head serves R consecutive value heads
    ks = tl.arange(0, BK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < DK, vs < DV
    s_ptrs = st_ptr + row * s_sb + h * s_sh + ks[:, None] * s_sk + vs[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_ok, other=0.0)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(T):
        base = qkv_ptr + row * s_qb + t * s_qt
        q = tl.load(base + (hk * DK + ks) * s_qc, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(base + (KEY_DIM + hk * DK + ks) * s_qc, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(base + (2 * KEY_DIM + h * DV + vs) * s_qc, mask=v_ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        gate = row * s_ab + t * s_at + h * s_ah
        g = neg_a * _softplus(tl.load(a_ptr + gate).to(tl.float32) + dt_bias)
        b = tl.load(b_ptr + gate).to(tl.float32)
        beta = rounded(1.0 / (1.0 + tl.exp(-b)), b_ptr.dtype.element_ty)  # sigmoid in b's dtype
        decayed = state * tl.exp(g)
        delta = (v - tl.sum(decayed * k[:, None], axis=0)) * beta
        real = tl.load(mask_ptr + row * s_mb + t * s_mt) != 0
        state = tl.where(real, decayed + k[:, None] * delta[None, :], state)  # padding: the same bits
        o = tl.sum(state * q[:, None], axis=0)
        o = rounded(o, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + row * s_ob + t * s_ot + h * s_oh + vs, o, mask=v_ok)
    tl.store(s_ptrs, state, mask=s_ok)


def _mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """bool -> uint8 without a copy (the kernels read one byte a token)."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)


def conv_decode(qkv: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, 1, C], conv_state [B, K-1, C] (updated in place where ``mask`` [B, 1] is True), weight [C, 1, K]
    -> silu(causal depthwise conv) [B, 1, C] in qkv's dtype (``out`` when given)."""
    bsz, _, c = qkv.shape
    kw = weight.shape[-1]
    assert qkv.stride(-1) == 1 and conv_state.stride(-1) == 1 and weight.is_contiguous()
    out = qkv.new_empty((bsz, 1, c)) if out is None else out
    if bsz == 0:
        return out
    m = _mask_bytes(mask)
    _conv_decode_kernel[(bsz, cdiv(c, CONV_BLOCK))](
        qkv, qkv.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), weight, m, m.stride(0),
        out, out.stride(0), c, KW=kw, BKW=next_pow2(kw), BC=CONV_BLOCK, num_warps=4)
    return out


def recurrent(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              mask: torch.Tensor, state: torch.Tensor, num_k_heads: int, k_dim: int, scale: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The gated delta rule token by token from the conv output ``qkv`` [B, T, 2 Hk dk + Hv dv] (any strides: the
    prefill conv's output is channel-strided), the gates' inputs a/b [B, T, Hv], A_log/dt_bias [Hv] and the token
    mask [B, T]; ``state`` fp32 [B, Hv, dk, dv] advanced in place -> o [B, T, Hv, dv] in ``out_dtype``."""
    bsz, t, _ = qkv.shape
    hv, _, dv = state.shape[1:]
    assert a.stride() == b.stride() and state.stride(-1) == 1 and state.dtype == torch.float32
    out = torch.empty((bsz, t, hv, dv), dtype=out_dtype, device=qkv.device)
    if bsz == 0 or t == 0:
        return out
    if qkv.stride(-1) != 1 and qkv.numel() >= 2**31:  # channel offsets times a stride stay int32
        qkv = qkv.contiguous()
    m = _mask_bytes(mask)
    bv = min(BLOCK_V, next_pow2(dv))
    _recurrent_kernel[(bsz * hv, cdiv(dv, bv))](
        qkv, qkv.stride(0), qkv.stride(1), qkv.stride(2), a, b, a.stride(0), a.stride(1), a.stride(2), a_log, dt_bias,
        m, m.stride(0), m.stride(1), state, state.stride(0), state.stride(1), state.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2), t, scale,
        HV=hv, R=hv // num_k_heads, DK=k_dim, DV=dv, KEY_DIM=num_k_heads * k_dim, BK=max(16, next_pow2(k_dim)),
        BV=bv, num_warps=WARPS)
    return out
