"""Grouped Triton kernels for MXFP4 experts (gpt-oss as published), decoding e2m1 in the K loop.

Same contract as the AWQ kernels (:mod:`moeflow.kernels.experts.gemm`): an align-block-size routing plan
(``torch.ops.moeflow.routing_plan``), weights read from the slot pool through ``slot_of_expert``, blocks of
experts outside ``expert_mask`` return at once (a staged computation writes each selected row exactly as a
single pass), ``out`` ``[T*k, H]`` written in place for the selected pairs, :func:`moeflow.kernels.combine`
afterwards. The plain-torch reference is :func:`moeflow.kernels.experts.biased.biased_expert_forward_reference`.

One kernel for every T, operand-swapped like the AWQ kernel: a program computes ``acc [BLOCK_N, DOT_M] =
W[n-tile, :] @ X^T``, the decoded weight tile is the MMA's register operand and the token rows its N side.

* Weights: ``blocks`` uint8 ``[S, K/P, N, P/32, 16]`` and ``scales`` ``[S, K/P, N, P/32]``, indexed by K panel
  ``P`` (:mod:`moeflow.kernels.experts.mxfp4_reference`); MXFP4's bytes with the bits of each 32-bit word permuted
  at load
  (:func:`~moeflow.kernels.experts.mxfp4_reference.to_kernel_layout`), read as int32 words: word ``j`` of a row's panel
  holds ``k = 8j .. 8j + 7`` of it, one 16-byte load = one 32-value block. The pointers take the slot, panel and
  row strides of the tensors: the slot pool stores panel after panel (a decode iteration, ``BLOCK_K = P``, reads
  one contiguous range of ``BLOCK_N P/2`` weight bytes and one of ``BLOCK_N P/32`` scale bytes), and the published
  row-major order is the same tensor with other strides (``mxfp4_reference.row_major_as_panels``; the GPU
  benchmark times both: ``layouts`` in ``benchmarks/run_gpu_mxfp4.py``'s JSON). A tile lies in one panel
  (``BLOCK_K <= P``) or covers whole panels (``BLOCK_K`` a multiple of ``P``); the weight strides are passed in
  units of a row's panel (``P/2`` bytes) so that the compiler knows the rows are aligned for 16-byte loads.
* Decode without lookups or conversions: the bf16 bits ``s 00000 e1 e0 m 000000`` of ``e2m1 * 2**-126``
  (exact; e2m1's subnormal 0.5 lands on a bf16 subnormal) of the pair ``(k 2p, 2p + 1)``, both halves of one
  int32, are ``(w << 3p) & 0x81C081C0`` for p = 0, 1, 2 (p = 0: one AND) and three shifted fields for p = 3.
  Joined so that each decoded int32 is one bf16 pair of the MMA operand in k order (no repacking). Times
  ``2**126`` and times the block's ``2**(scale - 127)``: bf16 multiplies by powers of two (``HMUL2.BF16_V2``,
  no flush-to-zero), exact: bf16 has fp32's exponent range and subnormals, so every decoded weight equals the
  fp32 reference's (scale 0's 2**-127 is a bf16 subnormal too).
* ``MODE 0`` (w13): weight rows of a tile alternate gate row ``j`` / up row ``I + j`` (the pool keeps gate rows
  first), so one accumulator holds both; epilogue ``+ bias`` and silu or gpt-oss's clamped SwiGLU in fp32 ->
  ``h [P, I]`` by pair. ``MODE 1`` (w2): ``+ bias``, times the fp32 routing weight -> ``out [P, H]``.
* ``SPLIT_K > 1`` (grid dim 1, whole ``BLOCK_K`` tiles per split): fp32 partials to a workspace, then the serial
  fixup of :mod:`.triton_experts` (the tile's last program sums the splits in order, adds the bias once, runs
  the epilogue, resets its counter): one launch per stage at every split. Decode defaults: :func:`stage_configs`.
* ``BLOCK_K`` divides K (no masks in the loop); rows past N are clamped to N - 1 and never stored; token rows
  past the plan's count read row 0 and are never stored; int32 offsets inside an expert, int64 slot base.
* bf16 activations: bf16 MMA, fp32 accumulation. fp16 / fp32 activations: the decoded weights and the
  activations multiplied in fp32 (``ieee``): exact weights either way. Under ``TRITON_INTERPRET=1`` bf16 runs
  through fp32 too (the interpreter's bf16 ``tl.dot`` is wrong; the products are the same).

Importing this module imports triton: on a CPU ``TRITON_INTERPRET=1`` must be set before the import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moeflow.kernels import workspace
from moeflow.kernels.experts import configs
from moeflow.kernels.experts.configs import block_k_for
from moeflow.kernels.experts.mxfp4_reference import BLOCK, PANEL, from_panels, row_major_as_panels
from moeflow.kernels.pool import ExpertPool
from moeflow.kernels.triton_common import (
    INTERPRETED,
    block_expert,
    cdiv,
    gemm_epilogue,
    next_pow2,
    plan_rows,
    splitk_fixup,
)

if TYPE_CHECKING:
    from moeflow.kernels.experts.ops import Alloc

ACTIVATION_CODES = {"silu": 0, "clamped_swiglu": 1}
# per stage: weight rows per program, k per iteration (a multiple of 32 that divides K: reduced at launch; the
# pool's K panel, so that an iteration reads one contiguous range)
DEFAULTS = {"BLOCK_N": 128, "BLOCK_K": PANEL, "num_warps": 4, "num_stages": 1}
PREFILL_BLOCK_M = 64  # from here on the loop is software-pipelined (cp.async, asynchronous wgmma)


# programs of the decode tile (BLOCK_N 128, BLOCK_K 64, 4 warps, 1 stage; with the split-K fixup) one H100 SM
# holds: benchmarks/results/sass/mxfp4-splitk.json's programs_per_sm (92-96 registers, 18 KB shared memory)
DECODE_PROGRAMS_PER_SM = 5


def stage_defaults(block_m: int) -> dict:
    """Default launch config of one stage: decode loads straight into registers (fewest instructions per weight,
    benchmarks/sass_mxfp4.py); prefill tiles pipeline the loads so the tensor cores run asynchronously."""
    return {**DEFAULTS, "num_stages": 3 if block_m >= PREFILL_BLOCK_M else 1}


# decode (w13, w2) splits benchmarks/run_gpu_mxfp4.py --splits times at the default tile (1 / 2 / 4 / 8 each)
SPLIT_CANDIDATES = tuple((s13, s2) for s13 in (1, 2, 4, 8) for s2 in (1, 2, 4, 8))


def stage_configs(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                  config: dict | None = None) -> dict:
    """``{"BLOCK_M", "w13", "w2"}`` of one layer: ``config`` over the defaults. At decode (T <= 16) each stage's
    default ``SPLIT_K`` is the wave rule :func:`moeflow.kernels.experts.configs.wave_split` at
    ``DECODE_PROGRAMS_PER_SM``
    over ``min(E, T k)`` plan blocks (one launch per stage at every split: the in-kernel fixup reduces).
    gpt-oss-120b (H = I = 2880, 128 experts, top-4; 660 program slots): T = 1 w13 180 programs -> split 8
    (1440 = 2.2 waves, 73 %), w2 92 -> 4 (368, 56 %); T = 2 w13 360 -> 4 (1440, 73 %), w2 184 -> 4 (736, 56 %);
    T = 4 w13 720 -> 4 (2880, 87 %), w2 368 -> 4 (1472, 74 %); T = 8: w13 1440 -> 2 (2880, 87 %), w2 736 -> 8
    (5888, 89 %); T = 16: w13 2880 -> 1, w2 1472 -> 4 (5888, 89 %). gpt-oss-20b (32 experts) is the same up to
    T = 8 (T k <= 32 blocks); T = 16: 32 blocks, as T = 8."""
    config = config or {}
    block_m = int(config.get("BLOCK_M", default_block_m(tokens, tokens * top_k, num_experts)))
    return configs.layer_stage_configs(tokens, num_experts, top_k, hidden, inter, block_m, stage_defaults(block_m),
                                       DECODE_PROGRAMS_PER_SM, config)
_CODE = -0x7E3F7E40  # 0x81C081C0 as int32: bf16 bits s..e1 e0 m of both halves (15, 8..6 / 31, 24..22)


@triton.jit
def _lo(v, FP32: tl.constexpr):
    """The low bf16 bit pattern of int32 ``v`` as bf16 (or, exactly, as fp32)."""
    if FP32:
        r = (v << 16).to(tl.float32, bitcast=True)
    else:
        r = v.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return r


@triton.jit
def _hi(v, FP32: tl.constexpr):
    """The high bf16 bit pattern of int32 ``v`` as bf16 (or fp32)."""
    if FP32:
        r = (v & -0x10000).to(tl.float32, bitcast=True)
    else:
        r = (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return r


@triton.jit
def _decode_e2m1(w, CODE: tl.constexpr, FP32: tl.constexpr):
    """Kernel-layout int32 words [BN, W] -> ``e2m1 * 2**-126`` [BN, 8W] in k order (bf16, or fp32 when FP32)."""
    a = w & CODE  # k 0, 1: already in place
    b = (w << 3) & CODE  # k 2, 3
    c = (w << 6) & CODE  # k 4, 5
    d = ((w >> 4) & 0x00400040) | ((w >> 6) & 0x01800180) | ((w << 4) & -0x7FFF8000)  # k 6, 7 (m, e1 e0, s)
    # join appends a last axis: [.., i, o, h] flattens to 4i + 2o + h = 2p + h (pair p = 2i + o, h = half), so
    # each bf16 pair of the MMA operand is one decoded int32
    lo = tl.join(tl.join(_lo(a, FP32), _lo(c, FP32)), tl.join(_lo(b, FP32), _lo(d, FP32)))
    hi = tl.join(tl.join(_hi(a, FP32), _hi(c, FP32)), tl.join(_hi(b, FP32), _hi(d, FP32)))
    return tl.reshape(tl.join(lo, hi), [w.shape[0], w.shape[1] * 8])


@triton.jit
def _mxfp4_gemm_kernel(
    a_ptr, stride_am,  # MODE 0: x [T, K] (row = pair // TOPK); MODE 1: h [P, K] (row = pair); last dim contiguous
    w_ptr, stride_ws, stride_wp, stride_wn,  # blocks as int32 [S, K/P, N_w, P/8]: strides in words, of P/8 words
    sc_ptr, stride_ss, stride_sp, stride_sn,  # scales uint8 [S, K/P, N_w, P/32]: strides in bytes
    bias_ptr, stride_bs,  # [S, N_w] (HAS_BIAS)
    c_ptr, stride_cm,  # output by pair: MODE 0 h [P, I], MODE 1 [P, H]
    ws_ptr, stride_wsp, stride_wsm,  # fp32 split-K partials [SPLIT_K, P, tiles * BLOCK_N] by pair (SPLIT_K > 1)
    cnt_ptr,  # int32 [>= grid dim 0] arrival counters, zero between launches (SPLIT_K > 1)
    sorted_ptr, eob_ptr, slot_ptr, mask_ptr, weight_ptr,
    num_pairs, N, K, N_UP, alpha, limit,
    TOPK: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, EVEN_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, CODE: tl.constexpr, FP32_DECODE: tl.constexpr, PANEL: tl.constexpr,
):
    # N: weight rows of the stage (MODE 0: 2I, gate rows then up rows; N_UP = I); the tile interleaves them
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = block_expert(eob_ptr, pid_m, mask_ptr, HAS_MASK)
    if expert < 0:  # past the padded count, or not selected: nothing to do (staged runs rely on it)
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)

    pair, row_ok, row = plan_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, DOT_M, TOPK, MODE)
    a_rows = a_ptr + row[None, :] * stride_am  # [1, DOT_M]

    i = tl.arange(0, BLOCK_N)
    if MODE == 0:  # tile row 2j: gate row n0/2 + j, tile row 2j + 1: up row N_UP + n0/2 + j
        col = pid_n * (BLOCK_N // 2) + i // 2
        rn = col + (i % 2) * N_UP
        if not EVEN_N:
            rn = tl.minimum(col, N_UP - 1) + (i % 2) * N_UP
    else:
        col = pid_n * BLOCK_N + i
        rn = col
        if not EVEN_N:
            rn = tl.minimum(col, N - 1)  # clamped: loads stay in bounds without masks
    PW: tl.constexpr = PANEL // 8  # words of a row in one panel
    PB: tl.constexpr = PANEL // 32  # scales of a row in one panel
    # weight strides in whole row panels: the compiler sees rows aligned for 16-byte loads. The scales' byte
    # strides hide their alignment on purpose: a 2-byte load per row lands in a layout that costs a shared-memory
    # exchange (2 barriers) per iteration, while single bytes load straight into the multiply's layout (SASS)
    w_panel = stride_wp * PW  # words from one panel to the next
    w_rows = w_ptr + slot * stride_ws + rn[:, None] * (stride_wn * PW)  # [BN, 1]
    s_rows = sc_ptr + slot * stride_ss + rn[:, None] * stride_sn  # [BN, 1]

    rk = tl.arange(0, BLOCK_K)
    rj = tl.arange(0, BLOCK_K // 8)
    rb = tl.arange(0, BLOCK_K // 32)
    # a tile's columns inside its first panel (BLOCK_K <= PANEL: all of them), and past it for whole panels
    w_cols = (rj // PW) * w_panel + rj % PW
    s_cols = (rb // PB) * stride_sp + rb % PB
    n_tiles = K // BLOCK_K
    if SPLIT_K == 1:
        t_begin = 0
        t_end = n_tiles
    else:  # whole BLOCK_K tiles per split (BLOCK_K divides K)
        t_per_split = tl.cdiv(n_tiles, SPLIT_K)
        t_begin = tl.program_id(1) * t_per_split
        t_end = min(t_begin + t_per_split, n_tiles)
    acc = tl.zeros([BLOCK_N, DOT_M], dtype=tl.float32)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        if BLOCK_K >= PANEL:  # whole panels
            w_at = t * (BLOCK_K // PANEL) * w_panel
            s_at = t * (BLOCK_K // PANEL) * stride_sp
        else:  # tile t % (PANEL / BLOCK_K) of panel t // (PANEL / BLOCK_K)
            w_at = (t // (PANEL // BLOCK_K)) * w_panel + (t % (PANEL // BLOCK_K)) * (BLOCK_K // 8)
            s_at = (t // (PANEL // BLOCK_K)) * stride_sp + (t % (PANEL // BLOCK_K)) * (BLOCK_K // 32)
        w = tl.load(w_rows + (w_at + w_cols)[None, :])  # int32 [BN, BK/8]
        sc = tl.load(s_rows + (s_at + s_cols)[None, :]).to(tl.int32)  # e8m0 [BN, BK/32]
        if FP32_DECODE:  # 2**(scale - 127) as fp32 bits (scale 0: the subnormal 2**-127)
            s = tl.where(sc == 0, 0x400000, sc << 23).to(tl.float32, bitcast=True)
        else:  # ... as bf16 bits
            s = tl.where(sc == 0, 0x40, sc << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        q = _decode_e2m1(w, CODE, FP32_DECODE) * 8.507059173023462e37  # times 2**126: the exact e2m1 values
        q = tl.reshape(tl.reshape(q, [BLOCK_N, BLOCK_K // 32, 32]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        xt = tl.load(a_rows + (k0 + rk)[:, None])  # [BLOCK_K, DOT_M]
        acc = tl.dot(q.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)

    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot * stride_bs + rn).to(tl.float32)[:, None]
        gemm_epilogue(tl.trans(acc), c_ptr, stride_cm, pair, row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE,
                      HAS_WEIGHT, BLOCK_N, alpha, limit, ACT)
    else:  # the serial fixup of triton_experts (module doc there): the tile's last program reduces
        ws = ws_ptr + pair.to(tl.int64)[:, None] * stride_wsm + (pid_n * BLOCK_N + i)[None, :]  # split 0's tile
        ok = row_ok[:, None]  # the workspace is padded to whole tiles: only rows need a mask
        bias_rows = None
        if HAS_BIAS:
            bias_rows = bias_ptr + slot * stride_bs + rn
        splitk_fixup(tl.trans(acc), ws, stride_wsp, ok, tl.program_id(1), cnt_ptr, pid, bias_rows, c_ptr,
                     stride_cm, pair, row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE, HAS_WEIGHT, BLOCK_N, alpha, limit,
                     ACT, SPLIT_K)


def dot_m(block_m: int) -> int:
    """Token columns of the swapped MMA: at least 16."""
    return max(16, block_m)


def default_block_m(tokens: int, num_pairs: int, num_experts: int) -> int:
    """Rows per plan block. Up to 16 tokens: the next power of two >= T, so an expert shared by several tokens
    is one block (its weights streamed once) at no cost (the MMA's N side is 16 columns anyway). Above: the
    average rows an expert gets, as a power of two in [16, 64]."""
    if tokens <= 16:
        return next_pow2(tokens)
    per_expert = max(1, num_pairs // max(1, min(num_experts, num_pairs)))
    return min(PREFILL_BLOCK_M, max(16, next_pow2(per_expert)))


def mxfp4_gemm(
    mode: int,
    a: torch.Tensor,  # MODE 0: x [T, K]; MODE 1: h [P, K]
    blocks: torch.Tensor,  # uint8 [S, K/P, N_w, P/32, 16]: the pool's panels, or row_major_as_panels' view
    scales: torch.Tensor,  # uint8 [S, K/P, N_w, P/32]
    bias: torch.Tensor | None,  # [S, N_w]
    out: torch.Tensor,  # MODE 0: h [P, N_w/2]; MODE 1: [P, N_w]
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
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Launch one grouped MXFP4 GEMM stage; writes the rows of selected experts of ``out`` in place (``alloc``:
    the split-K partials from the caller's persistent buffers, as a captured graph needs, else the scratch)."""
    from moeflow.kernels.experts.ops import split_k_partials

    cfg = {**stage_defaults(block_m), **(config or {})}
    K = a.shape[1]
    if blocks.dim() != 5 or scales.dim() != 4:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}: expected panel-indexed "
                         "[S, K/P, N, P/32, 16] / [S, K/P, N, P/32]")
    S, n_panels, n_w, pb, half = blocks.shape
    panel = pb * BLOCK
    shape_ok = tuple(scales.shape) == (S, n_panels, n_w, pb) and half == BLOCK // 2
    if not shape_ok or n_panels * panel != K or panel & (panel - 1):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not match K={K}")
    w_unit = panel // 2  # bytes of a row's panel of blocks
    # strides of the slot, panel and row dims (0 where the dim has one entry: any stride is right there)
    bst = [st if n > 1 else 0 for st, n in zip(blocks.stride()[:3], blocks.shape[:3], strict=True)]
    sst = [st if n > 1 else 0 for st, n in zip(scales.stride()[:3], scales.shape[:3], strict=True)]
    if (a.stride(1) != 1 or blocks.stride()[3:] != (half, 1) or scales.stride(3) != 1
            or any(st % w_unit for st in bst[1:]) or bst[0] % 4):
        raise ValueError("mxfp4_gemm: activations, each row's panel of blocks and of scales must be contiguous, "
                         "the blocks' panel and row strides whole row panels")
    words = blocks.view(torch.int32)  # [S, K/P, N_w, P/32, 4]: a row's panel is P/8 words at stride 1
    n_out = out.shape[1]
    bn = cfg["BLOCK_N"]
    if bn & (bn - 1) or bn < 16:
        raise ValueError(f"mxfp4_gemm: BLOCK_N must be a power of two >= 16, got {bn}")
    bk = block_k_for(K, int(cfg["BLOCK_K"]))
    tile_cols = bn // 2 if mode == 0 else bn  # output columns one program writes
    tiles = cdiv(n_out, tile_cols)
    split = max(1, int(cfg.get("SPLIT_K", 1)))
    grid = (expert_of_block.shape[0] * tiles, split)
    if split > 1:  # fp32 partials by pair, padded to whole tiles (no column masks); the counters stay zero
        shape = (split, out.shape[0], tiles * bn)
        ws = split_k_partials(shape, mode, a.device, alloc)
        cnt = workspace.counters(grid[0], a.device)
    else:
        ws, cnt = scales, slot_of_expert  # placeholders, never read
    dot_dtype = tl.bfloat16 if a.dtype == torch.bfloat16 and not INTERPRETED else tl.float32
    _mxfp4_gemm_kernel[grid](
        a, a.stride(0),
        words, bst[0] // 4, bst[1] // w_unit, bst[2] // w_unit,
        scales, sst[0], sst[1], sst[2],
        bias if bias is not None else scales, bias.stride(0) if bias is not None else 0,
        out, out.stride(0),
        ws, ws.stride(0) if split > 1 else 0, ws.stride(1) if split > 1 else 0, cnt,
        sorted_ids, expert_of_block, slot_of_expert,
        expert_mask if expert_mask is not None else slot_of_expert,
        topk_weights if topk_weights is not None else slot_of_expert,
        out.shape[0], n_w, K, n_w // 2 if mode == 0 else n_w, float(alpha), float(limit),
        TOPK=top_k, MODE=mode, ACT=ACTIVATION_CODES[activation], HAS_BIAS=bias is not None,
        HAS_MASK=expert_mask is not None, HAS_WEIGHT=topk_weights is not None,
        EVEN_N=n_out % tile_cols == 0, SPLIT_K=split, BLOCK_M=block_m, DOT_M=dot_m(block_m), BLOCK_N=bn, BLOCK_K=bk,
        DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else None, CODE=_CODE,
        FP32_DECODE=dot_dtype == tl.float32, PANEL=panel,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mxfp4_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # an MXFP4Format pool
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None = None,  # bool [E]
    *,
    config: dict | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Plan + w13 stage + w2 stage for the pairs of selected experts (``config``: ``{"BLOCK_M", "w13": {...},
    "w2": {...}}`` with ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``num_warps``, ``num_stages``; else
    :func:`stage_configs`' defaults). ``weights``: blocks and scales to read instead of the pool's (the same
    experts in another layout, e.g. :func:`row_major_copy`'s; the biases stay the pool's). ``alloc``: the plan,
    ``h`` and the split-K partials in the caller's persistent buffers (static shapes, no allocation: what a
    captured CUDA graph runs, :meth:`~moeflow.kernels.formats.layout.ExpertFormat.captured_forward`)."""
    from moeflow.kernels.experts.ops import plan_and_hidden

    fmt, t = pool.fmt, {**pool.tensors, **(weights or {})}
    T, top_k = topk_ids.shape
    num_experts = slot_of_expert.shape[0]
    config = stage_configs(T, num_experts, top_k, fmt.hidden_size, fmt.intermediate_size, config)
    block_m = config["BLOCK_M"]
    sorted_ids, expert_of_block, h = plan_and_hidden(x, topk_ids, num_experts, block_m, fmt.intermediate_size, alloc)
    act = dict(activation=fmt.activation, alpha=fmt.swiglu_alpha, limit=fmt.swiglu_limit)
    has_bias = fmt.bias
    mxfp4_gemm(0, x, t["w13_blocks"], t["w13_scales"], t["w13_bias"] if has_bias else None, h, sorted_ids,
               expert_of_block, slot_of_expert, expert_mask, None, top_k, block_m, **act, config=config.get("w13"),
               alloc=alloc)
    mxfp4_gemm(1, h, t["w2_blocks"], t["w2_scales"], t["w2_bias"] if has_bias else None, out, sorted_ids,
               expert_of_block, slot_of_expert, expert_mask, topk_weights.reshape(-1).float().contiguous(), 1,
               block_m, **act, config=config.get("w2"), alloc=alloc)
    return out


def row_major_copy(pool: ExpertPool) -> dict[str, torch.Tensor]:
    """The pool's MXFP4 blocks and scales copied into the published row-major order (``[S, N, K/32, 16]`` /
    ``[S, N, K/32]``, kernel bit layout kept), returned as the kernels' panel-indexed strided views of that copy,
    same names: the layout before K panels, for side-by-side timing (``mxfp4_expert_forward(weights=...)``)."""
    out = {}
    for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
        t = pool.tensors[name]  # [S, K/P, N, P/32, ...]
        row_major = torch.stack([from_panels(slot) for slot in t])  # [S, N, K/32, ...]
        out[name] = row_major_as_panels(row_major, t.shape[3] * BLOCK)
    return out
