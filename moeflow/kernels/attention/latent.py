"""MLA's absorbed decode attention over the rows of the server's latent cache, read in place (FlashMLA's shape).

One query token per sequence, already absorbed (``q_nope W_uk`` and the output's ``W_uv`` stay in torch,
moeflow.families.mla): query [B, H, 1, R + P] = ``[q_latent (kv_lora_rank R) | q_rope (P)]``. Every head attends
to the same latent vectors of its cache row ``rows[b]`` of one layer's latents [rows, max_len, >= R + P]: keys are
the first R + P columns, values the first R (MQA with D = R + P, Dv = R; DeepSeek-V3: 576 / 512, 128 heads).
Key j of [0, key_len) counts when ``valid[row, j]`` and ``j <= pos``, or ``j == pos`` (the rule of
:func:`moeflow.engine.kv_slots.slot_attention_mask`, no window), and (DeepSeek Sparse Attention) ``select[b, j]``.

* :func:`_partial_kernel`: grid ``(head tiles, splits, B)``. A program takes ``BLOCK_H`` heads (16 / 32 / 64) of one
  sequence and one contiguous chunk of the key axis; the head tiles of a (sequence, chunk) are neighbours in launch
  order, so the latents they share come from L2. Per ``BLOCK_N`` keys it loads the latent tile once, as
  ``[BLOCK_N, R]`` and ``[BLOCK_N, P]``, and computes transposed, keys and value columns as the dots' M (heads
  are N: 64 heads over 16 warps with mma.sync, where heads as M took wgmma and spilled): scores
  ``K_c q_latent^T + K_p q_rope^T`` ``[BLOCK_N, BLOCK_H]``, fp32 online softmax per head, ``acc^T += K_c^T p``
  ``[R, BLOCK_H]``; stores fp32 partials (max, sum, ``[BLOCK_H, R]``).
* :func:`_combine_kernel`: grid ``(B, 16-head chunks)``: the splits merged in split order 0..S-1 (deterministic),
  divided, stored in the query's dtype (rounded to nearest by bit arithmetic, as the interpreter needs).

Split count and partial shapes are host arithmetic on shapes only: a fixed grid for a fixed (B, key_len), nothing
read back, capturable as a CUDA graph. fp32 inputs use IEEE fp32 dots; on a GPU 16-bit inputs take the score dot in
their dtype (fp32 sums) and the probabilities rounded to the latents' dtype for the value dot, as the torch path
(``LatentAttention.absorbed``) does. :func:`latent_attention_reference` is the fp32 torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.experts.configs import key_splits
from moeflow.kernels.triton_common import INTERPRETED, cdiv, next_pow2, rounded

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128  # below this a split's fixed cost (q load, a [BLOCK_H, R] fp32 partial) outweighs its keys
BLOCK_N = 32  # keys per iteration (16 for fp32 caches: their tiles take twice the shared memory)
COMBINE_H = 16  # heads per combine program
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_config(heads: int, kv_rank: int, rope: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """The build's constexprs and warps (what benchmarks/sass_latent_attention.py compiles). Heads per program:
    64 (16 warps) above 32 heads, else 16 / 32 (4 / 8 warps); the program's fp32 accumulator [R, BLOCK_H] is
    its register budget: 128 registers a thread at R 512 in every build, and more heads a program means fewer
    programs reading the same latents (128 heads: each latent byte read twice, from L2 the second time)."""
    block_h = 64 if heads > 32 else max(16, next_pow2(heads))
    return {"BLOCK_H": block_h, "BLOCK_R": max(16, next_pow2(kv_rank)), "BLOCK_P": max(16, next_pow2(rope)),
            "BLOCK_N": 16 if dtype == torch.float32 else BLOCK_N, "num_warps": block_h // 4, "num_stages": 2}


def programs_per_sm(block_h: int) -> int:
    """Partial programs an sm_90 SM holds at R 512 / P 64 in bf16 (benchmarks/results/sass/latent-attention*.json,
    Triton 3.9 and 3.6): one of 64 or 32 heads (16 / 8 warps, 128 / 172 registers, 112 / 74 KB of shared
    memory), two of 16 (4 warps, 162-178 registers)."""
    return 2 if block_h <= 16 else 1


def default_splits(batch: int, head_tiles: int, key_len: int, block_h: int = 64) -> int:
    """Programs per (sequence, head tile) along the key axis: the fewest whose grid fills at least one H100 wave
    to ``configs.WAVE_FILL``, else the fullest; each split keeps ``MIN_SPLIT_KEYS`` keys at least. Shapes only.
    DeepSeek-V3 (128 heads: 2 tiles), 16 rows x 4096 keys: 4 (128 programs); 1 row: 32."""
    return key_splits(batch * head_tiles, programs_per_sm(block_h), cdiv(key_len, MIN_SPLIT_KEYS))


@triton.jit
def _partial_kernel(
    q_ptr, s_qb, s_qh,  # [B, H, 1, R + P]
    c_ptr, s_cr, s_cj,  # one layer's latents [rows, max_len, >= R + P], unit last stride
    rows_ptr,  # int64 [B]
    valid_ptr, s_vr,  # uint8 [rows, max_len]
    pos_ptr, s_pb,  # int64 [B, 1]
    sel_ptr, s_sb,  # uint8 [B, >= key_len] (DSA's selection), or any pointer when not HAS_SELECT
    m_ptr, l_ptr, acc_ptr,  # fp32 [B, S, HT, BLOCK_H] (m, l), [B, S, HT, BLOCK_H, BLOCK_R] (acc)
    key_len, chunk, qk_scale,  # qk_scale: softmax scale x log2(e)
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, HAS_SELECT: tl.constexpr, DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    ht = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    hs = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    rs = tl.arange(0, BLOCK_R)
    ps = tl.arange(0, BLOCK_P)
    h_ok = hs < H
    r_ok = rs < R
    p_ok = ps < P
    q_row = q_ptr + b * s_qb + hs[None, :] * s_qh  # transposed: keys are the dots' M, heads their N
    qc = tl.load(q_row + rs[:, None], mask=h_ok[None, :] & r_ok[:, None], other=0.0)  # [BLOCK_R, BLOCK_H]
    qp = tl.load(q_row + R + ps[:, None], mask=h_ok[None, :] & p_ok[:, None], other=0.0)  # [BLOCK_P, BLOCK_H]
    if DOT_FP32:
        qc = qc.to(tl.float32)
        qp = qp.to(tl.float32)
    row = tl.load(rows_ptr + b)
    pos = tl.load(pos_ptr + b * s_pb)
    base = c_ptr + row * s_cr  # int64 row offset
    lo = split * chunk
    hi = tl.minimum(lo + chunk, key_len)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_H), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        js = start + tl.arange(0, BLOCK_N)
        j_ok = js < hi
        tile = base + js[:, None] * s_cj
        if EVEN:
            kc = tl.load(tile + rs[None, :], mask=r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]: keys, values
            kp = tl.load(tile + R + ps[None, :], mask=p_ok[None, :], other=0.0)
        else:
            kc = tl.load(tile + rs[None, :], mask=j_ok[:, None] & r_ok[None, :], other=0.0)
            kp = tl.load(tile + R + ps[None, :], mask=j_ok[:, None] & p_ok[None, :], other=0.0)
        if DOT_FP32:
            kc = kc.to(tl.float32)
            kp = kp.to(tl.float32)
        valid = tl.load(valid_ptr + row * s_vr + js, mask=j_ok, other=0) != 0
        allowed = ((valid & (js <= pos)) | (js == pos)) & j_ok
        if HAS_SELECT:
            allowed = allowed & (tl.load(sel_ptr + b * s_sb + js, mask=j_ok, other=0) != 0)
        if IEEE:
            s = tl.dot(kc, qc, input_precision="ieee")
            s = tl.dot(kp, qp, acc=s, input_precision="ieee")
        else:
            s = tl.dot(kc, qc)
            s = tl.dot(kp, qp, acc=s)
        s = tl.where(allowed[:, None], s * qk_scale, float("-inf"))  # [BLOCK_N, BLOCK_H], log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: keep every term at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if IEEE:
            acc = tl.dot(tl.trans(kc), p, acc=acc * alpha[None, :], input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(kc), p.to(kc.dtype), acc=acc * alpha[None, :])
        m_i = m_new
    part = (b * tl.num_programs(1) + split) * tl.num_programs(0) + ht
    hb = tl.arange(0, BLOCK_H)
    tl.store(m_ptr + part * BLOCK_H + hb, m_i)
    tl.store(l_ptr + part * BLOCK_H + hb, l_i)
    tl.store(acc_ptr + (part * BLOCK_H + hb)[None, :] * BLOCK_R + rs[:, None], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr,  # the partials (see _partial_kernel)
    o_ptr, s_ob, s_oh,  # [B, H, 1, R] in the query's dtype
    S, HT, H: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    CH: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)  # CH heads: rows [sub * CH, sub * CH + CH) of head tile ht
    ht = c // (BLOCK_H // CH)
    hb = (c % (BLOCK_H // CH)) * CH + tl.arange(0, CH)
    hs = ht * BLOCK_H + hb
    rs = tl.arange(0, BLOCK_R)
    m = tl.full((CH,), float("-inf"), tl.float32)
    for s in range(S):
        m = tl.maximum(m, tl.load(m_ptr + ((b * S + s) * HT + ht) * BLOCK_H + hb))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding heads only: a real head always sees its own key
    l_sum = tl.zeros((CH,), tl.float32)
    acc = tl.zeros((CH, BLOCK_R), tl.float32)
    for s in range(S):
        part = ((b * S + s) * HT + ht) * BLOCK_H + hb
        w = tl.exp2(tl.load(m_ptr + part) - m)
        l_sum += tl.load(l_ptr + part) * w
        acc += tl.load(acc_ptr + part[:, None] * BLOCK_R + rs[None, :]) * w[:, None]
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    out = rounded(out, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * s_ob + hs[:, None] * s_oh + rs[None, :], out, mask=(hs < H)[:, None] & (rs < R)[None, :])


def covers(query: torch.Tensor, latent_layer: torch.Tensor) -> bool:
    """Whether :func:`latent_attention` takes this call: one query token, a float dtype shared with the cache,
    unit last strides, the same device (host metadata only)."""
    return (query.shape[2] == 1 and query.dtype in DTYPES and latent_layer.dtype == query.dtype
            and query.shape[-1] <= latent_layer.shape[-1] and query.stride(-1) == 1
            and latent_layer.stride(-1) == 1 and query.device == latent_layer.device)


def latent_attention(query: torch.Tensor, latent_layer: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                     cache_position: torch.Tensor, key_len: int, kv_rank: int, scale: float,
                     select: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """query [B, H, 1, R + P] (absorbed, R = ``kv_rank``); latent_layer [rows, max_len, >= R + P]; rows int64 [B];
    valid bool [rows, max_len]; cache_position int64 [B, 1]; key_len: keys [0, key_len) are read (static); scale:
    the softmax scale; select bool [B, >= key_len] (DSA) or None; splits: programs along the key axis (default
    :func:`default_splits`) -> context [B, H, 1, R] in the query's dtype. Two launches, nothing read back."""
    bsz, heads, _, d = query.shape
    assert covers(query, latent_layer) and 1 <= key_len <= latent_layer.shape[1] and 0 < kv_rank < d
    cfg = kernel_config(heads, kv_rank, d - kv_rank, query.dtype)
    bh, br, bn = cfg["BLOCK_H"], cfg["BLOCK_R"], cfg["BLOCK_N"]
    tiles = cdiv(heads, bh)
    s = splits or default_splits(bsz, tiles, key_len, bh)
    chunk = cdiv(cdiv(key_len, s), bn) * bn  # whole blocks per split; the last may be short or empty
    out = torch.empty((bsz, heads, 1, kv_rank), dtype=query.dtype, device=query.device)
    m = torch.empty((bsz, s, tiles, bh), dtype=torch.float32, device=query.device)
    lsum = torch.empty_like(m)
    acc = torch.empty((bsz, s, tiles, bh, br), dtype=torch.float32, device=query.device)
    valid_bytes = valid.view(torch.uint8)
    sel = select.view(torch.uint8) if select is not None else valid_bytes
    assert sel.stride(-1) == 1
    fp32 = query.dtype == torch.float32
    _partial_kernel[(tiles, s, bsz)](
        query, query.stride(0), query.stride(1), latent_layer, latent_layer.stride(0), latent_layer.stride(1),
        rows, valid_bytes, valid_bytes.stride(0), cache_position, cache_position.stride(0), sel, sel.stride(0),
        m, lsum, acc, key_len, chunk, scale * LOG2E,
        H=heads, R=kv_rank, P=d - kv_rank, BLOCK_H=bh, BLOCK_R=br, BLOCK_P=cfg["BLOCK_P"], BLOCK_N=bn,
        EVEN=key_len % bn == 0, HAS_SELECT=select is not None, DOT_FP32=INTERPRETED, IEEE=fp32 and not INTERPRETED,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _combine_kernel[(bsz, tiles * (bh // COMBINE_H))](
        m, lsum, acc, out, out.stride(0), out.stride(1), s, tiles,
        H=heads, R=kv_rank, BLOCK_H=bh, BLOCK_R=br, CH=COMBINE_H, num_warps=4)
    return out


def latent_attention_reference(query: torch.Tensor, latent_layer: torch.Tensor, rows: torch.Tensor,
                               valid: torch.Tensor, cache_position: torch.Tensor, key_len: int, kv_rank: int,
                               scale: float, select: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 torch reference of :func:`latent_attention` (same arguments): the rows' latents gathered, masked
    softmax -> context fp32 [B, H, 1, R]."""
    d = query.shape[-1]
    latents = latent_layer[:, :key_len, :d].index_select(0, rows).float()  # [B, L, R + P]
    keys = torch.arange(key_len, device=query.device)
    pos = cache_position[:, :1]  # [B, 1]
    allowed = (valid[:, :key_len].index_select(0, rows) & (keys <= pos)) | (keys == pos)
    if select is not None:
        allowed &= select[:, :key_len]
    scores = query.float() @ latents[:, None].transpose(-1, -2) * scale  # [B, H, 1, L]
    probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(dim=-1)
    return probs @ latents[:, None, :, :kv_rank]
