"""The combine: each token's k expert rows summed in fp32 in k order (deterministic, no atomics), optionally
fused with the w2 split-K reduction (the partials of each pair summed in split order, times the routing weight,
rounded to the activation dtype as the unfused w2 would store them, then combined): one launch instead of two.

Reference: :func:`moeflow.kernels.experts.reference.combine_reference` (and ``combine_partials_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton_common import cdiv, next_pow2


@triton.jit
def _combine_kernel(
    y_ptr, stride_ym,  # [T*k, H] per-pair outputs (unused with partials)
    ws_ptr, stride_wsp,  # fp32 [SPLIT_K, T*k, H] w2 partials by pair (SPLIT_K > 0)
    wt_ptr,  # fp32 [T*k] routing weights (SPLIT_K > 0)
    o_ptr, stride_om,  # [T, H]
    H, TOPK: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        if SPLIT_K > 0:
            part = tl.zeros([BLOCK_H], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part += tl.load(ws_ptr + s * stride_wsp + pair * H + offs, mask=mask, other=0.0)
            part = part * tl.load(wt_ptr + pair)
            acc += part.to(o_ptr.dtype.element_ty).to(tl.float32)
        else:
            acc += tl.load(y_ptr + pair * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + t * stride_om + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def combine(
    y: torch.Tensor | None,  # [T*k, H] (None with partials)
    top_k: int,
    out: torch.Tensor,  # [T, H]
    partials: torch.Tensor | None = None,  # fp32 [SPLIT_K, T*k, H]
    topk_weights: torch.Tensor | None = None,  # fp32 [T*k] (with partials)
) -> torch.Tensor:
    """out [T, H] = fp32 sum of each token's k rows, in k order; rows from ``y`` or from w2 split-K partials."""
    T, H = out.shape
    if T == 0 or H == 0:
        return out
    block_h = min(1024, next_pow2(H))
    src = y if y is not None else out
    _combine_kernel[(T, cdiv(H, block_h))](
        src, src.stride(0),
        partials if partials is not None else out, partials.stride(0) if partials is not None else 0,
        topk_weights if topk_weights is not None else out,
        out, out.stride(0), H,
        TOPK=top_k, SPLIT_K=partials.shape[0] if partials is not None else 0, BLOCK_H=block_h,
    )
    return out
