"""Grouped Triton kernels for MXFP4 experts (gpt-oss as published), decoding e2m1 in the K loop.

Same contract as the AWQ kernels (:mod:`moeflow.kernels.triton_kernels`): an align-block-size routing plan
(``torch.ops.moeflow.routing_plan``), weights read from the slot pool through ``slot_of_expert``, blocks of
experts outside ``expert_mask`` return at once (a staged computation writes each selected row exactly as a
single pass), ``out`` ``[T*k, H]`` written in place for the selected pairs, :func:`moeflow.kernels.combine`
afterwards. The plain-torch reference is :func:`moeflow.kernels.biased.biased_expert_forward_reference`.

* ``_mxfp4_gemm_kernel`` ``MODE 0`` (w13): gathers the rows of ``x`` named by the plan, computes the gate
  tile (weight rows ``n``) and the up tile (rows ``I + n``), adds the biases and stores the activation
  (silu or gpt-oss's clamped SwiGLU) in fp32 -> the activation dtype. ``MODE 1`` (w2): rows of ``h`` by pair,
  bias, times the fp32 routing weight.
* One K step is one MXFP4 block (32 values, one scale) per weight row: the scale is a per-row broadcast.
* Decode: an e2m1 code ``s e1 e0 m`` becomes the fp16 bit pattern ``s00000 e1 e0 m 000000000`` whose value is
  ``e2m1 * 2**-14`` (exact; e2m1's subnormal 0.5 lands on an fp16 subnormal), widened to fp32 and multiplied
  by ``2**(scale - 113)`` formed as fp32 bits ``(scale + 14) << 23`` (exact for scales <= 240, i.e. block
  multipliers up to 2**113). So every decoded weight equals the reference's exactly.
* ``BLOCK_M >= 16``: ``tl.dot`` tiles in the activation dtype (weights rounded exactly to it); ``BLOCK_M < 16``
  (decode): broadcast-multiply-reduce in fp32.

Importing this module imports triton: on a CPU ``TRITON_INTERPRET=1`` must be set before the import.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moeflow.kernels.mxfp4_reference import BLOCK
from moeflow.kernels.pool import ExpertPool

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # built for the CPU interpreter
ACTIVATION_CODES = {"silu": 0, "clamped_swiglu": 1}
DEFAULTS = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}


@triton.jit
def _e2m1_times_2_pow_m14(code):
    """int32 e2m1 codes (0..15) -> fp32 ``e2m1 * 2**-14`` (through the fp16 bit pattern; exact)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_hi_times_2_pow_m14(byte):
    """The high nibble's e2m1 code of int32 bytes -> fp32 ``e2m1 * 2**-14`` without shifting the code down first."""
    bits = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_w_block(w_base, s_base, stride_wn, stride_sn, offs_n, n_mask, kb, HALF: tl.constexpr):
    """Decoded fp32 weights W[offs_n, 32*kb : 32*kb + 32] -> [BLOCK_N, 32] (zero outside ``n_mask``)."""
    j = tl.arange(0, HALF)
    packed = tl.load(w_base + offs_n[:, None] * stride_wn + kb * HALF + j[None, :], mask=n_mask[:, None], other=0)
    packed = packed.to(tl.int32)
    w = tl.interleave(_e2m1_times_2_pow_m14(packed & 15), _e2m1_hi_times_2_pow_m14(packed))
    scale_bits = tl.load(s_base + offs_n * stride_sn + kb, mask=n_mask, other=0).to(tl.int32)
    scale = ((scale_bits + 14) << 23).to(tl.float32, bitcast=True)  # 2 ** (scale - 113)
    return w * scale[:, None]


@triton.jit
def _scaled_step(a, acc, w_base, s_base, stride_wn, stride_sn, offs_n, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """acc [BM, BN] += a bf16 [BM, BLOCK_K] @ W[offs_n, k0:k0+BLOCK_K].T through ``tl.dot_scaled`` (e2m1 + e8m0)."""
    jj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_base + offs_n[None, :] * stride_wn + jj[:, None],
                     mask=(jj < K // 2)[:, None] & n_mask[None, :], other=0)  # [BLOCK_K/2, BN], k-packed
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(s_base + offs_n[:, None] * stride_sn + g[None, :],
                     mask=n_mask[:, None] & (g < K // 32)[None, :], other=127)  # [BN, BLOCK_K/32]
    return tl.dot_scaled(a, None, "bf16", packed, scales, "e2m1", acc=acc)


@triton.jit
def _mxfp4_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # MODE 0: x [T, K] (row = pair // TOPK); MODE 1: h [P, K] (row = pair)
    w_ptr, stride_ws, stride_wn,  # blocks uint8 [S, N_w, K/2] (a row's K/32 blocks of 16 bytes, contiguous)
    sc_ptr, stride_ss, stride_sn,  # scales uint8 [S, N_w, K/32]
    bias_ptr, stride_bs,  # [S, N_w] (HAS_BIAS)
    c_ptr, stride_cm, stride_cn,  # output [P, N] indexed by pair
    sorted_ptr, eob_ptr, slot_ptr, mask_ptr, weight_ptr,
    num_pairs, N, K, N_UP, num_blocks, alpha, limit,
    TOPK: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CDTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr, BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = 16
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = tl.load(eob_ptr + pid_m)
    if expert < 0:
        return
    if HAS_MASK:
        if tl.load(mask_ptr + expert) == 0:
            return
    slot = tl.load(slot_ptr + expert).to(tl.int64)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    if MODE == 0:
        row = pair // TOPK
    else:
        row = pair
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + slot * stride_ws
    s_base = sc_ptr + slot * stride_ss
    offs_k = tl.arange(0, 32)

    if SCALED:  # bf16 activations: tl.dot_scaled decodes the e2m1 tile (Triton's own upcast) for the MMA
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.bfloat16)
            acc = _scaled_step(a, acc, w_base, s_base, stride_wn, stride_sn, offs_n, n_mask, k0, K, BLOCK_K)
            if MODE == 0:
                acc_up = _scaled_step(a, acc_up, w_base, s_base, stride_wn, stride_sn, offs_n + N_UP, n_mask, k0, K,
                                      BLOCK_K)
    elif BLOCK_M >= 16:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # decode: per-lane fp32 partial products, reduced over the block's 32 values once after the loop
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, 32], dtype=tl.float32)
        acc3_up = tl.zeros([BLOCK_M, BLOCK_N, 32], dtype=tl.float32)
    for kb in range(0, (K // 32) * (1 - SCALED)):
        a = tl.load(a_ptr + row[:, None] * stride_am + (kb * 32 + offs_k)[None, :] * stride_ak,
                    mask=row_ok[:, None], other=0.0)
        w = _load_w_block(w_base, s_base, stride_wn, stride_sn, offs_n, n_mask, kb, HALF)
        if BLOCK_M >= 16:
            acc = tl.dot(a.to(CDTYPE).to(DOT_DTYPE), tl.trans(w.to(CDTYPE).to(DOT_DTYPE)), acc=acc,
                         input_precision=DOT_PREC)
        else:
            acc3 += a.to(tl.float32)[:, None, :] * w[None, :, :]
        if MODE == 0:
            w = _load_w_block(w_base, s_base, stride_wn, stride_sn, offs_n + N_UP, n_mask, kb, HALF)
            if BLOCK_M >= 16:
                acc_up = tl.dot(a.to(CDTYPE).to(DOT_DTYPE), tl.trans(w.to(CDTYPE).to(DOT_DTYPE)), acc=acc_up,
                                input_precision=DOT_PREC)
            else:
                acc3_up += a.to(tl.float32)[:, None, :] * w[None, :, :]
    if BLOCK_M < 16:
        acc = tl.sum(acc3, axis=2)
        acc_up = tl.sum(acc3_up, axis=2)

    if HAS_BIAS:
        b = tl.load(bias_ptr + slot * stride_bs + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[None, :]
        if MODE == 0:
            b_up = tl.load(bias_ptr + slot * stride_bs + N_UP + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc_up += b_up[None, :]
    if MODE == 0:
        if ACT == 0:
            res = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:  # gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
            g = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            res = (up + 1.0) * (g / (1.0 + tl.exp(-(g * alpha))))
    else:
        res = acc
        if HAS_WEIGHT:
            res = res * tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_mask = row_ok[:, None] & n_mask[None, :]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, res.to(c_ptr.dtype.element_ty),
             mask=out_mask)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def default_block_m(num_pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows per plan block: bf16 activations always take 16+ row ``tl.dot_scaled`` tiles (its e2m1 decode is the
    cheapest in machine code, see benchmarks/sass_mxfp4.py); otherwise the average rows an expert gets, as a
    power of two (fp32 GEMV below 16, ``tl.dot`` tiles above)."""
    per_expert = max(1, num_pairs // max(1, min(num_experts, num_pairs)))
    block_m = min(64, triton.next_power_of_2(per_expert))
    return max(16, block_m) if dtype == torch.bfloat16 else block_m


def mxfp4_gemm(
    mode: int,
    a: torch.Tensor,  # MODE 0: x [T, K]; MODE 1: h [P, K]
    blocks: torch.Tensor,  # uint8 [S, N_w, K/32, 16]
    scales: torch.Tensor,  # uint8 [S, N_w, K/32]
    bias: torch.Tensor | None,  # [S, N_w]
    out: torch.Tensor,  # [P, N]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    topk_weights: torch.Tensor | None,  # fp32 [P]
    top_k: int,
    block_m: int,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch one grouped MXFP4 GEMM stage; writes the rows of selected experts of ``out`` in place."""
    cfg = {**DEFAULTS, **(config or {})}
    S, n_w, kb, half = blocks.shape
    K = a.shape[1]
    if half != BLOCK // 2 or kb * BLOCK != K or tuple(scales.shape) != (S, n_w, kb):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not match K={K}")
    n_out = out.shape[1]
    n_blocks = expert_of_block.shape[0]
    bn = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(n_out)))
    cdtype = _TL_DTYPES[a.dtype]
    # the interpreter's bf16 tl.dot is wrong: multiply the bf16-rounded operands in fp32 there (the same products
    # as bf16 tensor cores with fp32 accumulation)
    dot_dtype = tl.float32 if INTERPRETED and a.dtype == torch.bfloat16 else cdtype
    scaled = bool(cfg.get("SCALED", a.dtype == torch.bfloat16 and block_m >= 16))
    if scaled and (block_m < 16 or a.dtype != torch.bfloat16 or cfg["BLOCK_K"] % 32):
        raise ValueError(f"SCALED (tl.dot_scaled) needs bf16 activations, BLOCK_M >= 16 and BLOCK_K a multiple of 32; "
                         f"got {a.dtype}, BLOCK_M={block_m}, BLOCK_K={cfg['BLOCK_K']}")
    mask_arg = expert_mask if expert_mask is not None else slot_of_expert
    weight_arg = topk_weights if topk_weights is not None else slot_of_expert
    bias_arg = bias if bias is not None else scales
    grid = (n_blocks * triton.cdiv(n_out, bn),)
    _mxfp4_gemm_kernel[grid](
        a, a.stride(0), a.stride(1),
        blocks, blocks.stride(0), blocks.stride(1),
        scales, scales.stride(0), scales.stride(1),
        bias_arg, bias_arg.stride(0),
        out, out.stride(0), out.stride(1),
        sorted_ids, expert_of_block, slot_of_expert, mask_arg, weight_arg,
        out.shape[0], n_out, K, n_out, n_blocks, float(alpha), float(limit),
        TOPK=top_k, MODE=mode, ACT=ACTIVATION_CODES[activation], HAS_BIAS=bias is not None,
        HAS_MASK=expert_mask is not None, HAS_WEIGHT=topk_weights is not None, BLOCK_M=block_m, BLOCK_N=bn,
        CDTYPE=cdtype, DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else None,
        SCALED=scaled, BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mxfp4_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # a BiasedExpertFormat pool of kind "mxfp4"
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None = None,  # bool [E]
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Plan + w13 stage + w2 stage for the pairs of selected experts (``config``: ``{"BLOCK_M", "w13": {...},
    "w2": {...}}`` with ``BLOCK_N``, ``num_warps``, ``num_stages``; defaults otherwise)."""
    from moeflow.kernels.ops import routing_plan

    fmt, t = pool.fmt, pool.tensors
    T, top_k = topk_ids.shape
    num_pairs, num_experts = T * top_k, slot_of_expert.shape[0]
    config = config or {}
    block_m = int(config.get("BLOCK_M", default_block_m(num_pairs, num_experts, x.dtype)))
    sorted_ids, expert_of_block, _ = routing_plan(topk_ids, num_experts, block_m, "triton")
    h = x.new_empty((num_pairs, fmt.intermediate_size))
    act = dict(activation=getattr(fmt, "activation", "silu"), alpha=getattr(fmt, "swiglu_alpha", 1.702),
               limit=getattr(fmt, "swiglu_limit", 7.0))
    has_bias = getattr(fmt, "bias", False)
    mxfp4_gemm(0, x, t["w13_blocks"], t["w13_scales"], t["w13_bias"] if has_bias else None, h, sorted_ids,
               expert_of_block, slot_of_expert, expert_mask, None, top_k, block_m, **act, config=config.get("w13"))
    mxfp4_gemm(1, h, t["w2_blocks"], t["w2_scales"], t["w2_bias"] if has_bias else None, out, sorted_ids,
               expert_of_block, slot_of_expert, expert_mask, topk_weights.reshape(-1).float().contiguous(), 1,
               block_m, **act, config=config.get("w2"))
    return out
