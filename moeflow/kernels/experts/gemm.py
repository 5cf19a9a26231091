"""The grouped expert GEMM (W4A16 or dense) over a routing plan, reading the slot pool's kernel layout.

One kernel for every T, operand-swapped: a program computes ``acc [BLOCK_N, DOT_M] = W^T[n-tile, :] @ X^T``,
so the dequantized weight is the MMA's register operand (A) and the few token rows are its N side (>= 8).
Weights come in the panel-major layout of :mod:`moeflow.kernels.pool` (``qweight [S, K/P, N, P/8]``, read
by strides, so the former row-major ``[S, N, K/8]`` viewed as panels, ``pool.rows_as_panels``, works too):
one K iteration of a program reads one contiguous range (BLOCK_N x P/2 bytes at BLOCK_K = P), one 16-byte
load is one output column's 32 consecutive k, and the whole dequantization of a nibble is one ``LOP3`` (mask |
``0x4B000000``, the fp32 of ``2^23 + q * 16^i``) and one ``FFMA`` (times ``16^-i`` minus ``2^(23-4i) + z``),
which gives ``q - z`` exactly. ``BLOCK_K`` never exceeds the group: one zero/scale row per tile.

* ``SCALE_IN_A = False`` (decode): ``acc += dot(q - z, X^T) * s`` — exact integer operands, the scale applied
  to the fp32 partial of each group (more precise than rounding ``(q - z) * s`` to bf16).
* ``SCALE_IN_A = True`` (prefill): ``acc = dot(((q - z) * s).to(bf16), X^T, acc)`` — one accumulator chain, so
  the tensor cores run asynchronously (``wgmma`` with pending groups) while the next tile is dequantized.
* ``MODE 0`` (w13): rows of the tile alternate gate / up (the pool's interleaved layout), so one accumulator
  holds both; epilogue ``silu(gate) * up`` in fp32 -> ``h [P, I]`` by pair. ``MODE 1`` (w2): times the fp32
  routing weight of the pair -> ``out [P, H]``. ``SPLIT_K > 1`` stores fp32 partials ``[SPLIT_K, P, N]`` (by
  pair); with ``FIXUP`` the last program of a tile to arrive sums them and runs the epilogue (below), without
  it the combine (:mod:`.triton_combine`) sums them (w2 at decode). Both sum in split order 0..SPLIT_K-1.

Serial split-K fixup ("last arriver reduces", CUTLASS's serial split-K / stream-K fixup): every split program
stores its fp32 partial tile, passes a CTA barrier, then bumps the tile's int32 counter with one acq_rel,
GPU-scope atomic; the program that reads ``SPLIT_K - 1`` back sums all partials in split order (deterministic
whichever program arrives last), runs the epilogue and resets the counter to 0, so every launch leaves the
counters zero (CUDA-graph replays need no memset). The ordering follows CUTLASS's ``cutlass/barrier.h``
(``arrive_inc``: ``__syncthreads`` then one thread's release, whose fence also releases the other threads'
earlier weak writes; ``wait_eq``: one thread's acquire, then ``__syncthreads``) and Triton's scalar atomics
(one thread issues ``atom.acq_rel.gpu``, the result reaches every thread through shared memory and a barrier);
the partials are read with ``.cg`` (L2, never a stale L1 line).

Offsets inside one expert are int32, the slot base int64. Masks on N vanish when ``BLOCK_N`` divides N; token
rows past the plan's count read row 0 (a valid row) and are never stored, so the loads carry no masks.
Blocks whose expert is ``-1`` or not in ``expert_mask`` return at once (staged runs equal one pass bitwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels import workspace
from moeflow.kernels.triton_common import (
    INTERPRETED,
    TL_DTYPES,
    block_expert,
    cdiv,
    gemm_epilogue,
    plan_rows,
    splitk_fixup,
)


@triton.jit
def _nibble(word, mask, SH: tl.constexpr, zc):
    """q - z (exact fp32) of the nibble ``mask`` selects; ``zc = 2^(23 - 4 SH) + z``."""
    t = ((word & mask) | 0x4B000000).to(tl.float32, bitcast=True)
    return t * (1.0 / (1 << (4 * SH))) - zc


@triton.jit
def _dequant_tile(w, z, nib):
    """Packed words ``w`` int32 [BN, BK/8] (nibble i = k 8j+i) and zeros z fp32 [BN, 1] -> q - z fp32 [BN, BK]."""
    m0 = nib  # a runtime 0xF: keeps the four masks in registers (immediates would be re-materialised per use)
    m1 = nib << 4
    m2 = nib << 8
    m3 = nib << 12
    hi = w >> 16
    z0 = z + 8388608.0
    z1 = z + 524288.0
    z2 = z + 32768.0
    z3 = z + 2048.0
    # joined so that the flattened last axis runs over nibbles 0..7 in k order
    a = tl.join(
        tl.join(tl.join(_nibble(w, m0, 0, z0), _nibble(hi, m0, 0, z0)),
                tl.join(_nibble(w, m2, 2, z2), _nibble(hi, m2, 2, z2))),
        tl.join(tl.join(_nibble(w, m1, 1, z1), _nibble(hi, m1, 1, z1)),
                tl.join(_nibble(w, m3, 3, z3), _nibble(hi, m3, 3, z3))),
    )
    return tl.reshape(a, [w.shape[0], w.shape[1] * 8])


@triton.jit
def _expert_gemm_kernel(
    a_ptr, stride_am,  # MODE 0: x [T, K] (row = pair // TOPK); MODE 1: h [P, K] (row = pair); last dim contiguous
    b_ptr, stride_bs, stride_bn,  # AWQ qweight [S, K/P, N, P/8] int32 (stride_bn: between rows), or dense [S, N, K]
    z_ptr, stride_zs, stride_zg,  # AWQ qzeros [S, K/g, N/8]
    s_ptr, stride_ss, stride_sg,  # AWQ scales [S, K/g, N]
    c_ptr, stride_cm,  # output by pair: MODE 0 h [P, N/2], MODE 1 [P, N]
    ws_ptr, stride_wsp,  # fp32 split-K partials [SPLIT_K, P, N] (rows by pair, row stride N)
    cnt_ptr,  # int32 [>= grid dim 0] arrival counters, zero between launches (FIXUP)
    sorted_ptr, eob_ptr, slot_ptr, mask_ptr, weight_ptr,
    num_pairs, N, K, num_blocks, nib, stride_bp,  # stride_bp: between AWQ qweight panels of PANEL k
    PANEL: tl.constexpr, ROW_WORDS: tl.constexpr,  # AWQ: k per qweight panel, qweight words between rows
    TOPK: tl.constexpr, GROUP: tl.constexpr, AWQ: tl.constexpr, MODE: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_IN_A: tl.constexpr, FIXUP: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    bias_ptr=None, stride_bias=0, alpha=1.702, limit=7.0,  # bias [S, N] (kernel row order) or None; ACT 1's knobs
    ACT: tl.constexpr = 0,  # MODE 0 activation: 0 silu(gate) * up, 1 gpt-oss's clamped SwiGLU (see gemm_epilogue)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M consecutive plan blocks share the weight tiles of one column strip (L2 reuse)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows

    expert = block_expert(eob_ptr, pid_m, mask_ptr, HAS_MASK)
    if expert < 0:  # past the padded count, or not selected: nothing to do (staged runs rely on it)
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)

    pair, row_ok, row = plan_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, DOT_M, TOPK, MODE)
    a_rows = a_ptr + row[None, :] * stride_am  # [1, DOT_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        rn_ld = rn
    else:
        rn_ld = tl.minimum(rn, N - 1)  # clamped: loads stay in bounds without masks
    b_base = b_ptr + slot * stride_bs
    z_base = z_ptr + slot * stride_zs
    s_base = s_ptr + slot * stride_ss

    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = min(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_N, DOT_M], dtype=tl.float32)
    rk0 = tl.arange(0, BLOCK_K)
    if AWQ:
        rj = tl.arange(0, BLOCK_K // 8)
        # a compile-time row stride: P/8 words (4 or 8 for groups of 32 / 64) is not one of the multiples of 16
        # Triton specializes on, and without it the 16-byte loads would split into single words
        b_rows = b_base + rn_ld[:, None] * ROW_WORDS
        zc_shift = (rn_ld % 8) * 4
        for k0 in range(k_begin, k_end, BLOCK_K):
            # BLOCK_K divides PANEL: a tile lies in one panel (at BLOCK_K = PANEL, at its start)
            if BLOCK_K == PANEL:
                w = tl.load(b_rows + (k0 // PANEL) * stride_bp + rj[None, :])
            else:
                kw = tl.multiple_of((k0 % PANEL) // 8, BLOCK_K // 8)
                w = tl.load(b_rows + (k0 // PANEL) * stride_bp + (kw + rj)[None, :])
            g = k0 // GROUP
            zw = tl.load(z_base + g * stride_zg + rn_ld // 8)
            z = ((zw >> zc_shift) & 0xF).to(tl.float32)
            s = tl.load(s_base + g * stride_sg + rn_ld).to(tl.float32)
            xt = tl.load(a_rows + (k0 + rk0)[:, None]).to(DOT_DTYPE)  # [BLOCK_K, DOT_M]
            q = _dequant_tile(w, z[:, None], nib)
            if SCALE_IN_A:
                acc = tl.dot((q * s[:, None]).to(DOT_DTYPE), xt, acc=acc, input_precision=DOT_PREC)
            else:
                acc += tl.dot(q.to(DOT_DTYPE), xt, input_precision=DOT_PREC) * s[:, None]
    else:
        b_rows = b_base + rn_ld[:, None] * stride_bn
        for k0 in range(k_begin, k_end, BLOCK_K):
            rk = k0 + rk0
            if EVEN_K:
                w = tl.load(b_rows + rk[None, :])
                xt = tl.load(a_rows + rk[:, None])
            else:
                w = tl.load(b_rows + rk[None, :], mask=rk[None, :] < K, other=0.0)
                xt = tl.load(a_rows + rk[:, None], mask=rk[:, None] < K, other=0.0)
            acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)

    if SPLIT_K == 1:
        if bias_ptr is not None:  # one bias per weight row (w13: interleaved like the rows), added once in fp32
            acc += tl.load(bias_ptr + slot * stride_bias + rn_ld).to(tl.float32)[:, None]
        gemm_epilogue(tl.trans(acc), c_ptr, stride_cm, pair, row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE,
                      HAS_WEIGHT, BLOCK_N, alpha, limit, ACT)
    else:
        ok = row_ok[:, None] & (rn < N)[None, :]
        ws = ws_ptr + pair.to(tl.int64)[:, None] * N + rn[None, :]  # [DOT_M, BLOCK_N] of split 0
        if FIXUP:
            bias_rows = None
            if bias_ptr is not None:
                bias_rows = bias_ptr + slot * stride_bias + rn_ld
            splitk_fixup(tl.trans(acc), ws, stride_wsp, ok, pid_k, cnt_ptr, pid, bias_rows, c_ptr, stride_cm, pair,
                         row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE, HAS_WEIGHT, BLOCK_N, alpha, limit, ACT,
                         SPLIT_K)
        else:  # partials for the combine to sum (w2)
            tl.store(ws + pid_k * stride_wsp, tl.trans(acc), mask=ok)


def dot_m(block_m: int) -> int:
    """Token columns of the swapped MMA: at least 16 (N = 8 compiles to a longer loop with Triton 3.6)."""
    return max(16, block_m)


def expert_gemm(
    mode: int,
    a: torch.Tensor,  # MODE 0: x [T, K]; MODE 1: h [P, K]
    weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],  # (qweight [S, K/P, N, P/8], qzeros,
    # scales) | (w [S, N, K], None, None)
    # of every slot [S, ...], or of one matrix without the slot dim (a dense linear: slot stride 0)
    out: torch.Tensor,  # MODE 0: h [P, N/2]; MODE 1: [P, N]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    topk_weights: torch.Tensor | None,  # fp32 [P]
    num_pairs: int,
    top_k: int,
    group_size: int,
    cfg: dict,
    ws: torch.Tensor | None = None,  # fp32 [SPLIT_K, P, N] for the partials (None: a workspace buffer)
    reduce: bool = True,  # SPLIT_K > 1: the in-kernel fixup sums the splits (False: the caller sums ``ws``, e.g.
    # the combine; MODE 1 without bias only)
    bias: torch.Tensor | None = None,  # [S, N] per weight row in kernel order (w13: interleaved), added once
    activation: str = "silu",  # MODE 0: "silu" or "clamped_swiglu" (gpt-oss, with ``alpha`` / ``limit``)
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Launch the grouped GEMM: one launch at every SPLIT_K (split partials reduced by the tile's last program
    through ``workspace.counters``, or left in ``ws`` for the caller with ``reduce=False``)."""
    qweight, qzeros, scales = weights
    awq = qzeros is not None
    K = a.shape[1]
    N = qweight.shape[-2]  # weight rows (MODE 0: 2I interleaved)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    panel, stride_bp, row_words = 1, 0, 0
    if awq:  # qweight [S, K/P, N, P/8] or one matrix [K/P, N, P/8]
        panel, stride_bp, row_words = qweight.shape[-1] * 8, qweight.stride(-3), qweight.stride(-2)
        # one zero/scale row and one panel per tile (the kernel relies on both; powers of two: min divides both)
        block_k = min(block_k, group_size, panel)
    n_blocks = expert_of_block.shape[0]
    split_k = max(1, int(cfg.get("SPLIT_K", 1)))
    act = {"silu": 0, "clamped_swiglu": 1}[activation]
    if split_k > 1 and not reduce and (mode == 0 or bias is not None):
        raise ValueError("expert_gemm: reduce=False (the caller sums the partials) is for MODE 1 without a bias")
    if split_k > 1 and ws is None:  # a reused buffer: no allocation per call (launches on a stream never overlap)
        ws = workspace.scratch(workspace.SPLIT_K_PARTIALS, (split_k, num_pairs, N), torch.float32, a.device)
    elif split_k == 1:
        ws = out
    z, s = (qzeros, scales) if awq else (qweight, qweight)
    cdtype = TL_DTYPES[a.dtype]
    # the interpreter's bf16 tl.dot is wrong: fp32 operands there (the same products as bf16 tensor cores)
    dot_dtype = tl.float32 if INTERPRETED and a.dtype == torch.bfloat16 else cdtype
    grid = (n_blocks * cdiv(N, block_n), split_k)
    fixup = split_k > 1 and reduce
    cnt = workspace.counters(grid[0], a.device) if fixup else sorted_ids  # placeholder when unused
    one = qweight.dim() == (3 if awq else 2)  # one matrix: every block reads slot 0, the slot stride is unused
    _expert_gemm_kernel[grid](
        a, a.stride(0),
        qweight, 0 if one else qweight.stride(0), qweight.stride(-2),
        z, 0 if one else z.stride(0), z.stride(-2),
        s, 0 if one else s.stride(0), s.stride(-2),
        out, out.stride(0),
        ws, ws.stride(0) if split_k > 1 else 0, cnt,
        sorted_ids, expert_of_block, slot_of_expert,
        expert_mask if expert_mask is not None else slot_of_expert,
        topk_weights if topk_weights is not None else slot_of_expert,
        num_pairs, N, K, n_blocks, 0xF, stride_bp,
        TOPK=top_k, PANEL=panel, ROW_WORDS=row_words, GROUP=group_size if awq else 1, AWQ=awq, MODE=mode,
        HAS_MASK=expert_mask is not None, HAS_WEIGHT=topk_weights is not None, SPLIT_K=split_k,
        EVEN_N=N % block_n == 0, EVEN_K=K % (block_k * split_k) == 0, SCALE_IN_A=bool(cfg.get("SCALE_IN_A", 0)),
        FIXUP=fixup,
        BLOCK_M=block_m, DOT_M=dot_m(block_m), BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.get("GROUP_M", 1),
        DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else None,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        **({} if bias is None and not act else
           dict(bias_ptr=bias, stride_bias=0 if bias is None else bias.stride(0), alpha=float(alpha),
                limit=float(limit), ACT=act)),
    )
    return out

