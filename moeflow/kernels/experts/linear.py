"""The W4A16 GEMM on AWQ tensors *as published* (``qweight [K, N/8]`` in AWQ's nibble order): what
:func:`moeflow.kernels.awq_linear` runs for the dense (attention) layers of an AWQ checkpoint. The experts, and
linears packed once by ``kernels.pack_awq_linear``, use :mod:`moeflow.kernels.experts.gemm` instead (about
a third of the instructions per weight: see ``benchmarks/results/sass/``).

``BLOCK_M >= 16`` uses ``tl.dot`` tiles; ``BLOCK_M < 16`` a GEMV-shaped broadcast-multiply and reduce in fp32.
``BLOCK_K`` is clamped to the group: one zero/scale row per tile. Reference: ``reference.awq_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton_common import INTERPRETED, TL_DTYPES, cdiv


@triton.jit
def _expand8(p):
    """[..., C] -> [..., 8C], element j = p[..., j // 8]: one load per packed int32 instead of eight."""
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    return tl.interleave(p, p)


@triton.jit
def _load_w_tile(
    b_ptr, z_ptr, s_ptr,  # qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]
    stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
    offs_k,  # int64 [BLOCK_K] absolute k
    n0,  # int64 weight column of the tile start (a multiple of 8)
    n_left,  # valid columns from n0 on (N is a multiple of 8)
    k0, K,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, CDTYPE: tl.constexpr,
):
    """Dequantized weight tile W[offs_k, n0:n0+BLOCK_N] ([BLOCK_K, BLOCK_N], dtype CDTYPE), zero outside.

    (q - z) * s is formed in fp32 and rounded once to CDTYPE (the same value as a correctly rounded CDTYPE
    product); the interpreter's int32 -> bf16 cast and bf16 multiply are wrong, fp32 sidesteps both.
    """
    r = tl.arange(0, BLOCK_N)
    offs_n = n0 + r
    n_mask = r < n_left
    k_mask = offs_k < K
    mask = k_mask[:, None] & n_mask[None, :]
    r8 = tl.arange(0, BLOCK_N // 8)
    col8 = n0 // 8 + r8
    m8 = r8 * 8 < n_left
    # column n of a block of 8 sits in nibble [0, 4, 1, 5, 2, 6, 3, 7][n % 8] (n0 % 8 == 0)
    shifts = (((r % 8) // 2 + (r % 2) * 4) * 4).to(tl.int32)
    packed = tl.load(b_ptr + offs_k[:, None] * stride_bk + col8[None, :] * stride_bn,
                     mask=k_mask[:, None] & m8[None, :], other=0)
    q = (_expand8(packed) >> shifts[None, :]) & 0xF
    g = k0 // GROUP  # BLOCK_K <= GROUP: one group per tile
    zp = tl.load(z_ptr + g * stride_zk + col8 * stride_zn, mask=m8, other=0)
    z = (_expand8(zp) >> shifts) & 0xF
    s = tl.load(s_ptr + g * stride_sk + offs_n * stride_sn, mask=n_mask, other=0.0)
    w = (q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]
    w = tl.where(mask, w, 0.0).to(CDTYPE)
    return w


@triton.jit
def _awq_linear_kernel(
    a_ptr, stride_am, stride_ak,  # x [M, K]
    b_ptr, stride_bk, stride_bn,  # qweight [K, N/8]
    z_ptr, stride_zk, stride_zn,  # qzeros [K/g, N/8]
    s_ptr, stride_sk, stride_sn,  # scales [K/g, N]
    c_ptr, stride_cm, stride_cn,  # out [M, N]
    M, N, K,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, CDTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n  # GROUP_M row blocks share the weight tiles of one column strip
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    n0 = pid_n.to(tl.int64) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        if BLOCK_M >= 16:
            w = _load_w_tile(b_ptr, z_ptr, s_ptr, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
                             offs_k, n0, N - n0, k0, K, GROUP, BLOCK_K, BLOCK_N, CDTYPE)
            acc = tl.dot(a.to(CDTYPE).to(DOT_DTYPE), w.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)
        else:  # decode: GEMV-shaped in fp32 (no 16-row tensor-core tile wasted)
            w = _load_w_tile(b_ptr, z_ptr, s_ptr, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
                             offs_k, n0, N - n0, k0, K, GROUP, BLOCK_K, BLOCK_N, tl.float32)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < N))


def awq_linear_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/g, N/8]
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
    cfg: dict,
) -> torch.Tensor:
    """x @ dequantize(qweight, qzeros, scales) -> [M, N] in x's dtype (fp32 accumulation), a fresh tensor."""
    M, K = x.shape
    N = scales.shape[1]
    out = x.new_empty((M, N))
    cdtype = TL_DTYPES[x.dtype]
    # the interpreter's bf16 tl.dot is wrong: multiply the (bf16-rounded) operands in fp32 there
    dot_dtype = tl.float32 if INTERPRETED and x.dtype == torch.bfloat16 else cdtype
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _awq_linear_kernel[(cdiv(M, bm) * cdiv(N, bn),)](
        x, x.stride(0), x.stride(1), qweight, qweight.stride(0), qweight.stride(1),
        qzeros, qzeros.stride(0), qzeros.stride(1), scales, scales.stride(0), scales.stride(1),
        out, out.stride(0), out.stride(1), M, N, K,
        GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(cfg["BLOCK_K"], group_size),
        GROUP_M=cfg.get("GROUP_M", 1), CDTYPE=cdtype, DOT_DTYPE=dot_dtype,
        DOT_PREC="ieee" if dot_dtype == tl.float32 else None,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )
    return out
