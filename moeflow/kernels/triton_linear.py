"""The W4A16 GEMM on AWQ tensors *as published* (``qweight [K, N/8]`` in AWQ's nibble order): what
:func:`moeflow.kernels.awq_linear` runs for the dense (attention) layers of an AWQ checkpoint. The experts use
:mod:`moeflow.kernels.triton_experts` on the pool's own layout instead.

``BLOCK_M >= 16`` uses ``tl.dot`` tiles; ``BLOCK_M < 16`` a GEMV-shaped broadcast-multiply and reduce in fp32,
optionally split over K (``SPLIT_K > 1``) into an fp32 workspace that ``_splitk_reduce_kernel`` sums in a fixed
order (deterministic, no atomics). ``BLOCK_K`` is clamped to the group: one zero/scale row per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton_common import INTERPRETED, TL_DTYPES


@triton.jit
def _expand8(p):
    """[..., C] -> [..., 8C], element j = p[..., j // 8]: one load per packed int32 instead of eight."""
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    return tl.interleave(p, p)


@triton.jit
def _load_w_tile(
    b_ptr, z_ptr, s_ptr,  # expert base pointers (already offset to the slot)
    stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
    offs_k,  # int64 [BLOCK_K] absolute k
    n0,  # int64 weight column of the tile start (a multiple of 8)
    n_left,  # valid columns from n0 on (N is a multiple of 8)
    k0, K,
    AWQ: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, CDTYPE: tl.constexpr,
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
    if AWQ:
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
    else:
        w = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=mask, other=0.0)
        w = w.to(CDTYPE)
    return w


@triton.jit
def _store_epilogue(acc, acc_up, c_ptr, stride_cm, stride_cn, pair, offs_n, row_ok, mask, weight_ptr,
                    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """The numeric contract's epilogue, shared by the GEMM and the split-K reduction: MODE 0 stores
    silu(gate) * up, MODE 1 the product times the pair's routing weight; fp32 until the store."""
    if MODE == 0:
        res = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        res = acc
        if HAS_WEIGHT:
            wt = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            res = res * wt[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, res.to(c_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # MODE 0: x [T, K] (row = pair // TOPK); MODE 1: h [P, K] (row = pair)
    b_ptr, stride_bs, stride_bk, stride_bn,  # AWQ qweight [S, K, N/8] / dense, strides in (slot, k, n) sense
    z_ptr, stride_zs, stride_zk, stride_zn,  # AWQ qzeros [S, K/g, N/8]
    s_ptr, stride_ss, stride_sk, stride_sn,  # AWQ scales [S, K/g, N]
    c_ptr, stride_cm, stride_cn,  # output [P, N] indexed by pair
    ws_ptr, stride_wsp, stride_wsm,  # fp32 split-K workspace [n_blocks*BLOCK_M, SPLIT_K, N_WS] (plan position)
    sorted_ptr, eob_ptr, slot_ptr, mask_ptr, weight_ptr,
    num_pairs, N, K, N_UP,  # N output columns; MODE 0: up columns start at N_UP in the weight
    num_blocks,
    TOPK: tl.constexpr, GROUP: tl.constexpr, AWQ: tl.constexpr, MODE: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    CDTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M consecutive plan blocks share the weight tiles of one column strip
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_rows = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows

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
    n0 = pid_n.to(tl.int64) * BLOCK_N
    n_left = N - n0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    b_base = b_ptr + slot * stride_bs
    z_base = z_ptr + slot * stride_zs
    s_base = s_ptr + slot * stride_ss

    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = min(k_begin + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up projection (MODE 0 only; unused otherwise)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        a = tl.load(
            a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0,
        )
        if BLOCK_M >= 16:
            a = a.to(CDTYPE).to(DOT_DTYPE)
            w = _load_w_tile(b_base, z_base, s_base, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
                             offs_k, n0, n_left, k0, K, AWQ, GROUP, BLOCK_K, BLOCK_N, CDTYPE)
            acc = tl.dot(a, w.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)
            if MODE == 0:
                w = _load_w_tile(b_base, z_base, s_base, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk,
                                 stride_sn, offs_k, n0 + N_UP, n_left, k0, K, AWQ, GROUP, BLOCK_K, BLOCK_N, CDTYPE)
                acc_up = tl.dot(a, w.to(DOT_DTYPE), acc=acc_up, input_precision=DOT_PREC)
        else:
            # decode: GEMV-shaped, everything in fp32 (memory-bound; no 16-row tensor-core tile wasted)
            a = a.to(tl.float32)
            w = _load_w_tile(b_base, z_base, s_base, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk, stride_sn,
                             offs_k, n0, n_left, k0, K, AWQ, GROUP, BLOCK_K, BLOCK_N, tl.float32)
            acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1)
            if MODE == 0:
                w = _load_w_tile(b_base, z_base, s_base, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk,
                                 stride_sn, offs_k, n0 + N_UP, n_left, k0, K, AWQ, GROUP, BLOCK_K, BLOCK_N, tl.float32)
                acc_up += tl.sum(a[:, :, None] * w[None, :, :], axis=1)

    out_mask = row_ok[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        ws = ws_ptr + pid_k.to(tl.int64) * stride_wsp + offs_m[:, None] * stride_wsm + offs_n[None, :]
        tl.store(ws, acc, mask=out_mask)
        if MODE == 0:
            tl.store(ws + N, acc_up, mask=out_mask)
    else:
        _store_epilogue(acc, acc_up, c_ptr, stride_cm, stride_cn, pair, offs_n, row_ok, out_mask, weight_ptr,
                        MODE, HAS_WEIGHT)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, stride_wsp, stride_wsm,  # fp32 [n_blocks*BLOCK_M, SPLIT_K, N_WS]; split stride N_WS (small)
    c_ptr, stride_cm, stride_cn,  # [P, N]
    sorted_ptr, eob_ptr, mask_ptr, weight_ptr,
    num_pairs, N,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(eob_ptr + pid_m)
    if expert < 0:
        return
    if HAS_MASK:
        if tl.load(mask_ptr + expert) == 0:
            return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    base = ws_ptr + offs_m[:, None] * stride_wsm + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(base + s * stride_wsp, mask=mask, other=0.0)
        if MODE == 0:
            acc_up += tl.load(base + s * stride_wsp + N, mask=mask, other=0.0)
    _store_epilogue(acc, acc_up, c_ptr, stride_cm, stride_cn, pair, offs_n, row_ok, mask, weight_ptr, MODE, HAS_WEIGHT)


def grouped_gemm_triton(
    mode: int,
    a: torch.Tensor,  # MODE 0: x [T, K]; MODE 1: h [P, K]
    weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],  # (qweight, qzeros, scales) | (w,)
    out: torch.Tensor,  # [P, N]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    topk_weights: torch.Tensor | None,  # fp32 [P]
    num_pairs: int,
    top_k: int,
    n_out: int,
    group_size: int,
    cfg: dict,
) -> torch.Tensor:
    """Launch the grouped GEMM (and the split-K reduce). Writes the selected rows of ``out`` in place."""
    qweight, qzeros, scales = weights
    awq = qzeros is not None
    for key, low in (("BLOCK_M", 1), ("BLOCK_N", 16), ("BLOCK_K", 16)):
        v = cfg[key]
        if v < low or v & (v - 1):
            raise ValueError(f"kernel config {key}={v}: must be a power of two >= {low}")
    K = a.shape[1]
    block_m = cfg["BLOCK_M"]
    block_k = min(cfg["BLOCK_K"], group_size) if awq else cfg["BLOCK_K"]
    n_blocks = expert_of_block.shape[0]
    if awq:
        strides_b = (qweight.stride(0), qweight.stride(1), qweight.stride(2))
        z, s = qzeros, scales
        strides_z = (qzeros.stride(0), qzeros.stride(1), qzeros.stride(2))
        strides_s = (scales.stride(0), scales.stride(1), scales.stride(2))
    else:  # nn.Linear layout [S, N_w, K]: W[k, n] = w[n, k]
        strides_b = (qweight.stride(0), qweight.stride(2), qweight.stride(1))
        z = s = qweight
        strides_z = strides_s = (0, 0, 0)
    split_k = max(1, int(cfg.get("SPLIT_K", 1))) if block_m < 16 else 1
    n_ws = 2 * n_out if mode == 0 else n_out
    if split_k > 1:
        # row-major by plan position: the (int64) row offset carries the size, split offsets stay small
        ws = torch.empty((n_blocks * block_m, split_k, n_ws), dtype=torch.float32, device=a.device)
        ws_strides = (ws.stride(1), ws.stride(0))
    else:
        ws, ws_strides = out, (0, 0)
    mask_arg = expert_mask if expert_mask is not None else slot_of_expert
    weight_arg = topk_weights if topk_weights is not None else slot_of_expert
    cdtype = TL_DTYPES[a.dtype]
    # the interpreter's bf16 tl.dot is wrong: multiply the (bf16-rounded) operands in fp32 there, which gives the
    # same products as bf16 tensor cores with fp32 accumulation
    dot_dtype = tl.float32 if INTERPRETED and a.dtype == torch.bfloat16 else cdtype
    grid = (n_blocks * triton.cdiv(n_out, cfg["BLOCK_N"]), split_k)
    _moe_gemm_kernel[grid](
        a, a.stride(0), a.stride(1),
        qweight, *strides_b,
        z, *strides_z,
        s, *strides_s,
        out, out.stride(0), out.stride(1),
        ws, *ws_strides,
        sorted_ids, expert_of_block, slot_of_expert, mask_arg, weight_arg,
        num_pairs, n_out, K, n_out, n_blocks,
        TOPK=top_k, GROUP=group_size if awq else 1, AWQ=awq, MODE=mode,
        HAS_MASK=expert_mask is not None, HAS_WEIGHT=topk_weights is not None, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg.get("GROUP_M", 8),
        CDTYPE=cdtype, DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else None,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
    )
    if split_k > 1:
        bn = min(128, triton.next_power_of_2(n_out))
        _splitk_reduce_kernel[(n_blocks, triton.cdiv(n_out, bn))](
            ws, *ws_strides, out, out.stride(0), out.stride(1),
            sorted_ids, expert_of_block, mask_arg, weight_arg, num_pairs, n_out,
            MODE=mode, HAS_MASK=expert_mask is not None, HAS_WEIGHT=topk_weights is not None, SPLIT_K=split_k,
            BLOCK_M=block_m, BLOCK_N=bn,
        )
    return out
