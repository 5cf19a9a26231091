"""Decode attention over the rows of the server's slotted KV cache, read in place (flash-decoding).

One query token per sequence: q [B, heads, 1, D] attends to keys [0, key_len) of its cache row ``rows[b]`` of one
layer's K/V [rows, kv_heads, max_len, D], where a key j counts when ``valid[row, j]``, ``j <= pos`` and (sliding
window) ``pos - j < window``, or when ``j == pos`` (the query's own key, so no query sees an empty row): the mask of
:func:`moeflow.engine.kv_slots.slot_attention_mask`. Optional per-head sink logits (gpt-oss) join the softmax's
denominator only (:func:`moeflow.families.gpt_oss_layers.sink_attention`).

* :func:`_partial_kernel`: grid ``(B * kv_heads, splits)``. A program takes one (sequence, kv head) and one
  contiguous chunk of the key axis; all ``heads // kv_heads`` query heads of the kv head are the rows of one
  ``[BLOCK_H, D]`` tile (padded to 16 for ``tl.dot``), so K/V are read once per kv head, never gathered. It keeps
  an online softmax (fp32 max, sum and ``[BLOCK_H, D]`` accumulator) over ``BLOCK_N`` keys at a time and stores
  the three partials.
* :func:`_combine_kernel`: grid ``(B * kv_heads,)``: the splits merged in split order 0..S-1 (fixed order:
  bitwise the same run to run), the sink added, divided, stored in q's dtype (rounded to nearest: the
  interpreter's casts truncate).

The split count is host arithmetic on (B, kv_heads, key_len) only and the partials are allocated at host-known
shapes: no host read, a fixed grid for a fixed (B, key_len): CUDA-graph capturable. fp32 accumulation; on a GPU
the score dot takes q/K in their dtype (fp32 sums) and the value dot takes the probabilities rounded to V's dtype
(as FlashAttention); fp32 inputs use IEEE fp32 dots. :func:`slot_attention_reference` is the fp32 torch
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.experts.configs import key_splits
from moeflow.kernels.triton_common import INTERPRETED, cdiv, next_pow2, rounded

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 256  # below this a split's fixed cost (q load, partial store) outweighs its keys
# keys per loop iteration: [64, D] tiles of K and V. 128 at D 64 held 105 registers (138 with Triton 3.6: 3
# programs an SM instead of 6) for 0.062 warp-instructions per K/V byte instead of 0.080; fp32 spilled there
BLOCK_N = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def programs_per_sm(head_dim: int) -> int:
    """Partial programs an sm_90 SM holds (bf16; benchmarks/results/sass/slot-attention*.json, Triton 3.9 and 3.6:
    80-82 registers and 38 KB of shared memory at D 128, 76-77 registers and 20 KB at D 64)."""
    return 5 if head_dim > 64 else 6


def default_splits(batch: int, kv_heads: int, key_len: int, head_dim: int) -> int:
    """Programs per (sequence, kv head) along the key axis: the fewest whose grid fills at least one H100 wave
    (``configs.WAVE_FILL`` of its program slots, the waves as full), else the fullest; each split keeps
    ``MIN_SPLIT_KEYS`` keys at least. Shapes only: the same grid on every replay. Mixtral-8x7B
    (8 kv heads), 16 rows: 5 (640 programs, 0.97 of a wave); 1 row: 16 (256 keys each)."""
    return key_splits(batch * kv_heads, programs_per_sm(head_dim), cdiv(key_len, MIN_SPLIT_KEYS))


@triton.jit
def _partial_kernel(
    q_ptr, s_qb, s_qh,  # [B, H, 1, D]
    k_ptr, v_ptr, s_kr, s_kh, s_kj,  # [rows, KVH, max_len, D] (K and V share strides)
    rows_ptr,  # int64 [B]
    valid_ptr, s_vr,  # uint8 [rows, max_len]
    pos_ptr, s_pb,  # int64 [B, 1]
    m_ptr, l_ptr, acc_ptr,  # fp32 [B * KVH, S, BLOCK_H] (m, l), [B * KVH, S, BLOCK_H, BLOCK_D] (acc)
    key_len, chunk, window, qk_scale,  # qk_scale: softmax scale x log2(e)
    KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // KVH
    kvh = pid % KVH
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    q_ok = (hs < G)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * s_qb + (kvh * G + hs)[:, None] * s_qh + ds[None, :], mask=q_ok, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    row = tl.load(rows_ptr + b)
    pos = tl.load(pos_ptr + b * s_pb)
    base = row * s_kr + kvh * s_kh  # int64: the row's offset
    lo = split * chunk
    hi = tl.minimum(lo + chunk, key_len)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        js = start + tl.arange(0, BLOCK_N)
        j_ok = js < hi
        kv_off = base + js[:, None] * s_kj + ds[None, :]
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        valid = tl.load(valid_ptr + row * s_vr + js, mask=j_ok, other=0) != 0
        allowed = valid & (js <= pos)
        if HAS_WINDOW:
            allowed = allowed & (pos - js < window)
        allowed = (allowed | (js == pos)) & j_ok
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(allowed[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: keep every term at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = pid * tl.num_programs(1) + split
    tl.store(m_ptr + part * BLOCK_H + hs, m_i)
    tl.store(l_ptr + part * BLOCK_H + hs, l_i)
    tl.store(acc_ptr + (part * BLOCK_H + hs)[:, None] * BLOCK_D + ds[None, :], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr,  # the partials (see _partial_kernel)
    sink_ptr,  # [H] sink logits (natural-log units), or any pointer when not HAS_SINKS
    o_ptr, s_ob, s_oh,  # [B, H, 1, D] in q's dtype
    S, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // KVH
    kvh = pid % KVH
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    h_ok = hs < G
    first = pid * S
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in range(S):
        m = tl.maximum(m, tl.load(m_ptr + (first + s) * BLOCK_H + hs))
    if HAS_SINKS:
        sink = tl.load(sink_ptr + kvh * G + hs, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # padding heads only: a real head always sees its own key
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s in range(S):
        part = (first + s) * BLOCK_H + hs
        w = tl.exp2(tl.load(m_ptr + part) - m)
        l_sum += tl.load(l_ptr + part) * w
        acc += tl.load(acc_ptr + part[:, None] * BLOCK_D + ds[None, :]) * w[:, None]
    if HAS_SINKS:
        l_sum += tl.exp2(sink - m)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    out = rounded(out, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * s_ob + (kvh * G + hs)[:, None] * s_oh + ds[None, :], out,
             mask=h_ok[:, None] & (ds < D)[None, :])


def covers(q: torch.Tensor, k_layer: torch.Tensor) -> bool:
    """Whether :func:`slot_attention` takes this call: one query token, a float dtype shared with the cache,
    whole GQA groups, D <= 256 with unit stride (host metadata only)."""
    b, h, t, d = q.shape
    return (t == 1 and q.dtype in DTYPES and k_layer.dtype == q.dtype and h % k_layer.shape[1] == 0
            and d <= 256 and q.stride(-1) == 1 and k_layer.stride(-1) == 1 and q.device == k_layer.device)


def slot_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                   valid: torch.Tensor, cache_position: torch.Tensor, key_len: int, sliding_window: int | None,
                   sinks: torch.Tensor | None = None, scale: float | None = None, splits: int | None = None
                   ) -> torch.Tensor:
    """q [B, H, 1, D]; k_layer/v_layer [rows, KVH, max_len, D] (same strides); rows int64 [B]; valid bool
    [rows, max_len]; cache_position int64 [B, 1]; key_len: keys [0, key_len) are read (static); sinks [H] or None;
    scale: the softmax scale (default D^-0.5); splits: programs along the key axis (default
    :func:`default_splits`) -> out [B, H, 1, D] in q's dtype. Two launches, nothing read back."""
    bsz, heads, _, d = q.shape
    kvh = k_layer.shape[1]
    assert covers(q, k_layer) and k_layer.stride() == v_layer.stride() and 1 <= key_len <= k_layer.shape[2]
    g = heads // kvh
    bh, bd, bn = max(16, next_pow2(g)), max(16, next_pow2(d)), BLOCK_N
    s = splits or default_splits(bsz, kvh, key_len, d)
    chunk = cdiv(cdiv(key_len, s), bn) * bn  # whole blocks per split; the last split may be short or empty
    out = torch.empty((bsz, heads, 1, d), dtype=q.dtype, device=q.device)
    m = torch.empty((bsz * kvh, s, bh), dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty((bsz * kvh, s, bh, bd), dtype=torch.float32, device=q.device)
    valid_bytes = valid.view(torch.uint8)
    scale = d ** -0.5 if scale is None else scale
    fp32 = q.dtype == torch.float32
    _partial_kernel[(bsz * kvh, s)](
        q, q.stride(0), q.stride(1), k_layer, v_layer, k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
        rows, valid_bytes, valid_bytes.stride(0), cache_position, cache_position.stride(0), m, lsum, acc,
        key_len, chunk, sliding_window or 0, scale * LOG2E,
        KVH=kvh, G=g, D=d, BLOCK_H=bh, BLOCK_D=bd, BLOCK_N=bn, HAS_WINDOW=sliding_window is not None,
        DOT_FP32=INTERPRETED, IEEE=fp32 and not INTERPRETED, num_warps=4, num_stages=2)
    _combine_kernel[(bsz * kvh,)](
        m, lsum, acc, sinks if sinks is not None else m, out, out.stride(0), out.stride(1), s,
        KVH=kvh, G=g, D=d, BLOCK_H=bh, BLOCK_D=bd, HAS_SINKS=sinks is not None, num_warps=4)
    return out


def slot_attention_reference(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                             valid: torch.Tensor, cache_position: torch.Tensor, key_len: int,
                             sliding_window: int | None, sinks: torch.Tensor | None = None,
                             scale: float | None = None) -> torch.Tensor:
    """fp32 torch reference of :func:`slot_attention` (same arguments): the rows' keys gathered, masked softmax
    (with the sink logit in the denominator) -> out fp32 [B, H, 1, D]."""
    heads, d = q.shape[1], q.shape[-1]
    k = k_layer[:, :, :key_len].index_select(0, rows).float()  # [B, KVH, L, D]
    v = v_layer[:, :, :key_len].index_select(0, rows).float()
    g = heads // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    keys = torch.arange(key_len, device=q.device)
    pos = cache_position[:, :1]  # [B, 1]
    allowed = valid[:, :key_len].index_select(0, rows) & (keys <= pos)
    if sliding_window is not None:
        allowed &= pos - keys < sliding_window
    allowed |= keys == pos
    scores = q.float() @ k.transpose(2, 3) * (d ** -0.5 if scale is None else scale)  # [B, H, 1, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, heads, 1, 1).expand(q.shape[0], -1, 1, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :key_len]
    return probs @ v


def kernel_config(head_dim: int, heads: int, kv_heads: int) -> dict[str, int]:
    """The shipped build's constexprs and warps at these shapes (what benchmarks/sass_slot_attention.py compiles)."""
    return {"BLOCK_H": max(16, next_pow2(heads // kv_heads)), "BLOCK_D": max(16, next_pow2(head_dim)),
            "BLOCK_N": BLOCK_N, "num_warps": 4, "num_stages": 2}
