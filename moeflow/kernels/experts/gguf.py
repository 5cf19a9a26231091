"""Grouped Triton kernels for GGUF experts (:class:`~moeflow.kernels.formats.gguf.GGUFFormat`), decoding the ggml
blocks of the slot pool in the K loop: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
(:mod:`moeflow.kernels.experts.gguf_reference` has the layouts and the fp32 reference dequantizers).

Same contract as the AWQ and MXFP4 kernels (:mod:`moeflow.kernels.experts.gemm`, :mod:`moeflow.kernels.experts.mxfp4`):
an align-block-size routing plan (``moeflow.kernels.experts.ops.routing_plan``), weights read from the slot pool through
``slot_of_expert``, blocks of experts outside ``expert_mask`` return at once (a staged computation writes each
selected row exactly as a single pass), ``out`` ``[T*k, H]`` written in place for the selected pairs, fp32
accumulation, :func:`moeflow.kernels.combine` afterwards. Operand-swapped like those: a program computes ``acc
[BLOCK_N, DOT_M] = W[n-tile, :] @ X^T`` with the decoded weight tile as one operand.

* ``MODE 0`` (w13): one kernel reads both matrices: tile row ``2j`` is gate row ``n0/2 + j``, tile row ``2j + 1``
  up row ``n0/2 + j`` (``up`` sits ``up_off`` bytes after ``gate`` in every region), so the accumulator holds
  gate and up interleaved for :func:`~moeflow.kernels.triton_common.gemm_epilogue`'s ``silu(gate) * up`` (fp32,
  stored in the activation dtype) -> ``h [P, I]``. ``MODE 1`` (w2): times the fp32 routing weight -> ``out``.
* Decode (:func:`_decode`): per 32-element group of the tile (a 32-element block, a K-quant sub-block), its
  scale fields are loaded once per row ([BN, BK/32]: fp16 scales assembled from two bytes and bitcast, Q4_K /
  Q5_K's 6-bit scales and mins unpacked), its 32 quants as bytes [BN, BK/32, 32], and the value formed in fp32 in
  the reference's order. ``BLOCK_K`` is a power of two >= 32 dividing K (any such works for every type; a K-quant
  tile may span super-blocks). The blocks are read as stored: Q4_K / Q5_K blocks (144 / 176 bytes) stay 16-byte
  aligned and their quants load as vectors; Q4_0 / Q5_0 / Q8_0 / Q6_K blocks (18 / 22 / 34 / 210 bytes) are only 2-byte
  aligned, so their quants load two bytes at a time (:func:`_bytes`). ``benchmarks/sass/gguf.py`` (sm_90,
  Qwen3-30B-A3B shapes, default tiles) counts warp-instructions per weight of 0.26-0.31 (Q4_K), 0.43 (Q5_K), 0.71-0.79
  (Q6_K), 0.24-0.25 (Q4_0), 0.33 (Q8_0), 0.26 (Q5_1), 0.40 (Q5_0), against ~0.15 for HBM speed (the AWQ kernels: 0.133):
  ``benchmarks/results/sass/README.md``. GPU speed is unmeasured.
* A format may allow two block types per matrix (a model whose layers differ): the kernel is built with a K loop
  for each (``TYPE_A``, ``TYPE_B``); a program reads its region's ``types`` byte once and runs that type's loop
  (Q4_K_M's down in Q4_K / Q6_K: the same machine code per loop as a single-type build, more registers).
* ``SPLIT_K > 1`` (grid dim 1, whole ``BLOCK_K`` tiles per split): fp32 partials to a workspace and the serial
  fixup :func:`~moeflow.kernels.triton_common.splitk_fixup` (the tile's last program sums the splits in order):
  one launch per stage at every split. Decode default: the wave rule over the active plan blocks.
* fp32 activations: fp32 decoded weights and ``ieee`` dots (the reference's products). 16-bit activations: the
  decoded weights are rounded to the activation dtype for the MMA (fp32 accumulation); under
  ``TRITON_INTERPRET=1`` bf16 runs in fp32 (the interpreter's bf16 ``tl.dot`` is wrong).

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
from moeflow.kernels.experts.gguf_reference import GGMLType
from moeflow.kernels.experts.mxfp4 import default_block_m, dot_m
from moeflow.kernels.formats.layout import ExpertPool
from moeflow.kernels.triton_common import INTERPRETED, block_expert, cdiv, gemm_epilogue, plan_rows, splitk_fixup

if TYPE_CHECKING:
    from moeflow.kernels.experts.ops import Alloc

# per stage: weight rows per program and k per iteration (reduced at launch to a power of two dividing K)
DEFAULTS = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
PREFILL_BLOCK_M = 64
# decode programs per SM assumed by the split rule: not measured for these kernels (no GPU run yet); the AWQ
# kernels' figure (configs.DECODE_PROGRAMS_PER_SM)
DECODE_PROGRAMS_PER_SM = configs.DECODE_PROGRAMS_PER_SM


@triton.jit
def _f16_at(p):
    """Little-endian fp16 at uint8 pointers ``p`` -> fp32 (exact)."""
    bits = tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _bytes(p, N: tl.constexpr):
    """The ``N`` bytes at 2-byte aligned uint8 pointers ``p`` [BN, NB, 1] -> int32 [BN, NB, N], two bytes per
    16-bit load (the blocks of 18, 34 and 210 bytes are only 2-byte aligned: no wider loads)."""
    v = tl.load(p.to(tl.pointer_type(tl.int16)) + tl.arange(0, N // 2)[None, None, :]).to(tl.int32) & 0xFFFF
    return tl.reshape(tl.join(v & 255, v >> 8), [p.shape[0], p.shape[1], N])


@triton.jit
def _signed(v):
    """uint8 values (int32) -> int8 values (int32)."""
    return v - ((v & 128) << 1)


@triton.jit
def _decode(rows, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TYPE: tl.constexpr):
    """Weights of elements ``k0 .. k0 + BLOCK_K`` of the rows starting at uint8 pointers ``rows`` [BN, 1] -> fp32
    [BN, BK], the reference's values (``moeflow.kernels.experts.gguf_reference``'s layouts; TYPE = ``GGMLType.code``).
    Decoded per 32-element group ``J`` (a 32-element block, a K-quant sub-block): its scale fields are loaded
    once per (row, group) [BN, NB], its 32 quants as [BN, NB, 32]."""
    NB: tl.constexpr = BLOCK_K // 32
    J = k0 // 32 + tl.arange(0, NB)  # groups of the tile [NB]
    lane = tl.arange(0, 32)[None, None, :]  # element in its group
    if TYPE == 0:  # Q4_0: 18-byte blocks of 32
        b = rows + (J * 18)[None, :]  # [BN, NB]
        qs = _bytes(b[:, :, None] + 2, 16)  # [BN, NB, 16]: element l < 16 low nibbles, then the high ones
        q = tl.reshape(tl.permute(tl.join(qs & 15, qs >> 4), (0, 1, 3, 2)), [BLOCK_N, NB, 32]) - 8
        w = _f16_at(b)[:, :, None] * q.to(tl.float32)
    elif TYPE == 1:  # Q8_0: 34-byte blocks of 32
        b = rows + (J * 34)[None, :]
        w = _signed(_bytes(b[:, :, None] + 2, 32)).to(tl.float32) * _f16_at(b)[:, :, None]
    elif TYPE >= 5:  # Q4_1 (20 bytes: d, m, qs), Q5_0 (22: d, qh, qs), Q5_1 (24: d, m, qh, qs): blocks of 32
        if TYPE == 5:
            b = rows + (J * 20)[None, :]
            qs = _bytes(b[:, :, None] + 4, 16)
        elif TYPE == 6:
            b = rows + (J * 22)[None, :]
            qs = _bytes(b[:, :, None] + 6, 16)
        else:
            b = rows + (J * 24)[None, :]
            qs = _bytes(b[:, :, None] + 8, 16)
        q = tl.reshape(tl.permute(tl.join(qs & 15, qs >> 4), (0, 1, 3, 2)), [BLOCK_N, NB, 32])
        if TYPE != 5:  # the little-endian uint32 qh: bit l is bit 4 of element l
            if TYPE == 6:
                qh = _bytes(b[:, :, None] + 2, 4)
            else:
                qh = _bytes(b[:, :, None] + 4, 4)
            qh = tl.sum(qh << (8 * tl.arange(0, 4))[None, None, :], axis=2)  # int32 [BN, NB] (disjoint bytes)
            q = q | (((qh[:, :, None] >> lane) & 1) << 4)
        if TYPE == 6:
            w = _f16_at(b)[:, :, None] * (q - 16).to(tl.float32)
        else:
            w = (_f16_at(b)[:, :, None] * q.to(tl.float32)) + _f16_at(b + 2)[:, :, None]
    elif TYPE == 2 or TYPE == 3:  # Q4_K (144 bytes) / Q5_K (176 bytes): blocks of 256, sub-block j
        j = (J % 8)[None, :]
        if TYPE == 2:
            b = rows + ((J // 8) * 144)[None, :]
        else:
            b = rows + ((J // 8) * 176)[None, :]
        s_lo = _u8(b + 4 + j % 4)  # s[j] (j < 4), s[j - 4]
        s_hi = _u8(b + 8 + j % 4)  # s[j + 4] (j < 4), s[j]
        s_md = _u8(b + 12 + j % 4)  # s[j + 4] (j >= 4)
        sc = tl.where(j < 4, s_lo & 63, (s_md & 15) | ((s_lo >> 6) << 4))
        m = tl.where(j < 4, s_hi & 63, (s_md >> 4) | ((s_hi >> 6) << 4))
        b3 = b[:, :, None]
        j3 = j[:, :, None]
        if TYPE == 2:
            q = (_u8(b3 + 16 + (j3 // 2) * 32 + lane) >> ((j3 % 2) * 4)) & 15
        else:
            q = (_u8(b3 + 48 + (j3 // 2) * 32 + lane) >> ((j3 % 2) * 4)) & 15
            q = q | (((_u8(b3 + 16 + lane) >> j3) & 1) << 4)
        d = _f16_at(b) * sc.to(tl.float32)
        dm = _f16_at(b + 2) * m.to(tl.float32)
        w = d[:, :, None] * q.to(tl.float32) - dm[:, :, None]
    else:  # Q6_K: 210-byte blocks of 256; group jj = 4 n + g (half n, quarter g)
        jj = (J % 8)[None, :, None]
        n = jj // 4
        g = jj % 4
        b = rows + ((J // 8) * 210)[None, :]
        b3 = b[:, :, None]
        lo = (_bytes(b3 + 64 * n + 32 * (g % 2), 32) >> (4 * (g // 2))) & 15
        hi = (_bytes(b3 + 128 + 32 * n, 32) >> (2 * g)) & 3
        sc = _signed(_u8(b3 + 192 + 8 * n + 2 * g + tl.arange(0, 2)[None, None, :])).to(tl.float32)  # [BN, NB, 2]
        d = _f16_at(b + 208)[:, :, None] * sc  # scales of elements 0..15 and 16..31 of the group
        d = tl.reshape(tl.broadcast_to(d[:, :, :, None], [BLOCK_N, NB, 2, 16]), [BLOCK_N, NB, 32])
        w = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _k_loop(acc, w_rows, a_rows, t_begin, t_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TYPE: tl.constexpr,
            DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc fp32 [BN, DOT_M] += the decoded weight tiles ``t_begin .. t_end`` (of BLOCK_K) @ the activations'."""
    rk = tl.arange(0, BLOCK_K)
    for t in range(t_begin, t_end):
        w = _decode(w_rows, t * BLOCK_K, BLOCK_N, BLOCK_K, TYPE)  # fp32 [BN, BK]
        xt = tl.load(a_rows + (t * BLOCK_K + rk)[:, None])  # [BK, DOT_M]
        acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _gguf_gemm_kernel(
    a_ptr, stride_am,  # MODE 0: x [T, K] (row = pair // TOPK); MODE 1: h [P, K] (row = pair); last dim contiguous
    w_ptr, stride_ws, stride_wn, up_off,  # uint8 rows of blocks: slot and row strides in bytes; up - gate (MODE 0)
    types_ptr, stride_ts,  # uint8 [S, 2]: each region's type codes (gate/up, down); read when TYPE_B >= 0
    c_ptr, stride_cm,  # output by pair: MODE 0 h [P, I], MODE 1 [P, H]
    ws_ptr, stride_wsp, stride_wsm,  # fp32 split-K partials [SPLIT_K, P, tiles * BLOCK_N] by pair (SPLIT_K > 1)
    cnt_ptr,  # int32 arrival counters, zero between launches (SPLIT_K > 1)
    sorted_ptr, eob_ptr, slot_ptr, mask_ptr, weight_ptr,
    num_pairs, N, K, N_UP,
    TYPE_A: tl.constexpr, TYPE_B: tl.constexpr, TOPK: tl.constexpr, MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    EVEN_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, DOT_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # N: tile rows of the stage (MODE 0: 2I, gate and up interleaved; N_UP = I)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = block_expert(eob_ptr, pid_m, mask_ptr, HAS_MASK)
    if expert < 0:  # past the padded count, or not selected: nothing to do (staged runs rely on it)
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    code = TYPE_A
    if TYPE_B >= 0:  # the format allows two types for this matrix: this region's (uniform over the program)
        code = tl.load(types_ptr + slot * stride_ts + MODE).to(tl.int32)

    pair, row_ok, row = plan_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, DOT_M, TOPK, MODE)
    a_rows = a_ptr + row[None, :] * stride_am  # [1, DOT_M]

    i = tl.arange(0, BLOCK_N)
    if MODE == 0:
        col = pid_n * (BLOCK_N // 2) + i // 2
        if not EVEN_N:
            col = tl.minimum(col, N_UP - 1)  # clamped: loads stay in bounds, never stored
        w_rows = w_ptr + slot * stride_ws + (col * stride_wn + (i % 2) * up_off)[:, None]
    else:
        col = pid_n * BLOCK_N + i
        if not EVEN_N:
            col = tl.minimum(col, N - 1)
        w_rows = w_ptr + slot * stride_ws + (col * stride_wn)[:, None]

    n_tiles = K // BLOCK_K
    if SPLIT_K == 1:
        t_begin = 0
        t_end = n_tiles
    else:  # whole BLOCK_K tiles per split (BLOCK_K divides K)
        t_per_split = tl.cdiv(n_tiles, SPLIT_K)
        t_begin = tl.program_id(1) * t_per_split
        t_end = min(t_begin + t_per_split, n_tiles)
    acc = tl.zeros([BLOCK_N, DOT_M], dtype=tl.float32)
    if TYPE_B < 0:
        acc = _k_loop(acc, w_rows, a_rows, t_begin, t_end, BLOCK_N, BLOCK_K, TYPE_A, DOT_DTYPE, DOT_PREC)
    elif code == TYPE_A:  # one loop per type: the branch is taken once per program
        acc = _k_loop(acc, w_rows, a_rows, t_begin, t_end, BLOCK_N, BLOCK_K, TYPE_A, DOT_DTYPE, DOT_PREC)
    else:
        acc = _k_loop(acc, w_rows, a_rows, t_begin, t_end, BLOCK_N, BLOCK_K, TYPE_B, DOT_DTYPE, DOT_PREC)

    if SPLIT_K == 1:
        gemm_epilogue(tl.trans(acc), c_ptr, stride_cm, pair, row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE,
                      HAS_WEIGHT, BLOCK_N, 1.0, 0.0, 0)
    else:  # the serial fixup of triton_experts: the tile's last program reduces
        ws = ws_ptr + pair.to(tl.int64)[:, None] * stride_wsm + (pid_n * BLOCK_N + i)[None, :]  # split 0's tile
        splitk_fixup(tl.trans(acc), ws, stride_wsp, row_ok[:, None], tl.program_id(1), cnt_ptr, pid, None, c_ptr,
                     stride_cm, pair, row_ok, pid_n * BLOCK_N, N, weight_ptr, MODE, HAS_WEIGHT, BLOCK_N, 1.0, 0.0,
                     0, SPLIT_K)


def stage_configs(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                  config: dict | None = None) -> dict:
    """``{"BLOCK_M", "w13", "w2"}`` of one layer: ``config`` over :data:`DEFAULTS`; at decode (T <= 16) each
    stage's default ``SPLIT_K`` is :func:`moeflow.kernels.experts.configs.wave_split` over ``min(E, T k)`` plan
    blocks."""
    config = config or {}
    block_m = int(config.get("BLOCK_M", default_block_m(tokens, tokens * top_k, num_experts)))
    defaults = {**DEFAULTS, "num_stages": 2 if block_m >= PREFILL_BLOCK_M else 1}
    return configs.layer_stage_configs(tokens, num_experts, top_k, hidden, inter, block_m, defaults,
                                       DECODE_PROGRAMS_PER_SM, config)


def gguf_gemm(
    mode: int,
    a: torch.Tensor,  # MODE 0: x [T, K]; MODE 1: h [P, K]
    blocks: torch.Tensor,  # uint8 [S, N_rows, row_bytes]: gate (MODE 0; up follows at up_off) or down (MODE 1)
    up_off: int,  # bytes from each region's gate to its up (MODE 0)
    gtypes: tuple[GGMLType, ...],  # the one or two block types the matrix may hold
    type_codes: torch.Tensor,  # uint8 [S, 2]: each region's (gate/up, down) GGMLType.code
    out: torch.Tensor,  # MODE 0: h [P, I]; MODE 1: [P, H]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    topk_weights: torch.Tensor | None,  # fp32 [P]
    top_k: int,
    block_m: int,
    config: dict,
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Launch one grouped GGUF GEMM stage; writes the rows of selected experts of ``out`` in place (``alloc``:
    the split-K partials from the caller's persistent buffers, as a captured graph needs, else the scratch)."""
    from moeflow.kernels.experts.ops import split_k_partials

    K = a.shape[1]
    S, n_rows, row_bytes = blocks.shape
    names = "/".join(g.name for g in gtypes)
    if (not 1 <= len(gtypes) <= 2 or row_bytes != max(g.row_bytes(K) for g in gtypes) or blocks.stride(2) != 1
            or a.stride(1) != 1):
        raise ValueError(f"gguf_gemm: {names} blocks {tuple(blocks.shape)} do not hold K={K} contiguous rows")
    bn = int(config["BLOCK_N"])
    if bn & (bn - 1) or bn < 16:
        raise ValueError(f"gguf_gemm: BLOCK_N must be a power of two >= 16, got {bn}")
    bk = block_k_for(K, int(config["BLOCK_K"]))
    n_out = out.shape[1]
    n = 2 * n_rows if mode == 0 else n_rows
    tile_cols = bn // 2 if mode == 0 else bn
    tiles = cdiv(n_out, tile_cols)
    split = max(1, int(config.get("SPLIT_K", 1)))
    grid = (expert_of_block.shape[0] * tiles, split)
    if split > 1:  # fp32 partials by pair, padded to whole tiles; the counters stay zero between launches
        shape = (split, out.shape[0], tiles * bn)
        ws = split_k_partials(shape, mode, a.device, alloc)
        cnt = workspace.counters(grid[0], a.device)
    else:
        ws, cnt = out, slot_of_expert  # placeholders, never read
    dot_dtype = tl.float32 if a.dtype == torch.float32 or (INTERPRETED and a.dtype == torch.bfloat16) else (
        tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16)
    _gguf_gemm_kernel[grid](
        a, a.stride(0),
        blocks, blocks.stride(0) if S > 1 else 0, blocks.stride(1), up_off,
        type_codes, type_codes.stride(0) if S > 1 else 0,
        out, out.stride(0),
        ws, ws.stride(0) if split > 1 else 0, ws.stride(1) if split > 1 else 0, cnt,
        sorted_ids, expert_of_block, slot_of_expert,
        expert_mask if expert_mask is not None else slot_of_expert,
        topk_weights if topk_weights is not None else slot_of_expert,
        out.shape[0], n, K, n_rows,
        TYPE_A=gtypes[0].code, TYPE_B=gtypes[1].code if len(gtypes) > 1 else -1, TOPK=top_k, MODE=mode,
        HAS_MASK=expert_mask is not None,
        HAS_WEIGHT=topk_weights is not None, EVEN_N=n_out % tile_cols == 0, SPLIT_K=split, BLOCK_M=block_m,
        DOT_M=dot_m(block_m), BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=dot_dtype,
        DOT_PREC="ieee" if dot_dtype == tl.float32 else None,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out


def gguf_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # a GGUFFormat pool
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None = None,  # bool [E]
    *,
    config: dict | None = None,
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Plan + w13 stage + w2 stage for the pairs of selected experts (``config``: ``{"BLOCK_M", "w13": {...},
    "w2": {...}}`` with ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``num_warps``, ``num_stages``; else
    :func:`stage_configs`' defaults). ``alloc``: the plan, ``h`` and the split-K partials in the caller's
    persistent buffers (static shapes, no allocation: what a captured CUDA graph runs)."""
    from moeflow.kernels.experts.ops import plan_and_hidden

    fmt, t = pool.fmt, pool.tensors
    T, top_k = topk_ids.shape
    num_experts = slot_of_expert.shape[0]
    config = stage_configs(T, num_experts, top_k, fmt.hidden_size, fmt.intermediate_size, config)
    block_m = config["BLOCK_M"]
    sorted_ids, expert_of_block, h = plan_and_hidden(x, topk_ids, num_experts, block_m, fmt.intermediate_size, alloc)
    up_off = fmt.spec("up").offset - fmt.spec("gate").offset
    gguf_gemm(0, x, t["gate"], up_off, fmt.types_of("gate"), t["types"], h, sorted_ids, expert_of_block,
              slot_of_expert, expert_mask, None, top_k, block_m, config["w13"], alloc)
    gguf_gemm(1, h, t["down"], 0, fmt.types_of("down"), t["types"], out, sorted_ids, expert_of_block,
              slot_of_expert, expert_mask, topk_weights.reshape(-1).float().contiguous(), 1, block_m, config["w2"],
              alloc)
    return out
