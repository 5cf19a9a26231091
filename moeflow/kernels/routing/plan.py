"""Routing in one launch: softmax / top-k / renormalise of the router logits, the sentinel fill and the
align-block-size plan (counts, padded offsets, stable ranks, block table), all in one program.

References: :func:`moeflow.kernels.experts.reference.route_reference` and ``routing_plan_reference``. One program is
enough at decode (a few tokens); at prefill the plan is still one pass over the T*k pairs, a few microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton_common import cdiv, next_pow2


@triton.jit
def _topk_pass(p, e_range, TOPK: tl.constexpr, total, STORE: tl.constexpr, ids_ptr, wts_ptr, rt, t_ok):
    """Pick the k largest probabilities of each row (ties: lowest expert). STORE=False: return their sum;
    STORE=True: store ids and ``p / total`` (``total`` 1.0 when not renormalising)."""
    sel = p
    acc = tl.zeros_like(total)
    for j in tl.static_range(TOPK):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], e_range[None, :], 1 << 30), axis=1)
        if STORE:
            tl.store(ids_ptr + rt * TOPK + j, idx, mask=t_ok)
            tl.store(wts_ptr + rt * TOPK + j, best / total, mask=t_ok)
        acc += best
        sel = tl.where(e_range[None, :] == idx[:, None], -1.0, sel)
    return acc


@triton.jit
def _route_plan_kernel(
    logits_ptr, stride_lt,  # router logits [T, E] (ROUTE only); with GATE: x [T, H]
    gate_ptr, stride_ge, hidden,  # GATE: router weight [E, H] (nn.Linear layout); logits = x @ gate^T
    ids_ptr,  # int32 [T * k]: written here when ROUTE, read otherwise
    wts_ptr,  # fp32 [T * k] routing weights (ROUTE only)
    sorted_ptr,  # int32 [num_blocks * BLOCK_M]: sentinel-filled here, then the plan
    eob_ptr,  # int32 [num_blocks]
    npad_ptr,  # int32 [1]
    num_tokens, num_pairs, num_experts, num_blocks,
    TOPK: tl.constexpr, ROUTE: tl.constexpr, GATE: tl.constexpr, RENORM: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    e_range = tl.arange(0, E_PAD)
    e_ok = e_range < num_experts
    if ROUTE:
        for t0 in range(0, num_tokens, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_ok = rt < num_tokens
            if GATE:  # decode: the router GEMV here too (fp32 sums, rounded like F.linear's output)
                acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
                for h0 in range(0, hidden, BLOCK_H):
                    rh = h0 + tl.arange(0, BLOCK_H)
                    h_ok = rh < hidden
                    xv = tl.load(logits_ptr + rt[:, None] * stride_lt + rh[None, :],
                                 mask=t_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
                    gv = tl.load(gate_ptr + e_range[:, None] * stride_ge + rh[None, :],
                                 mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
                    acc += tl.sum(xv[:, None, :] * gv[None, :, :], axis=2)
                lg = acc.to(logits_ptr.dtype.element_ty).to(tl.float32)
                lg = tl.where(e_ok[None, :], lg, float("-inf"))
            else:
                lg = tl.load(logits_ptr + rt[:, None] * stride_lt + e_range[None, :],
                             mask=t_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
            lg = tl.where(t_ok[:, None], lg, 0.0)  # rows past T: finite, never stored
            ex = tl.exp(lg - tl.max(lg, axis=1)[:, None])
            p = ex / tl.sum(ex, axis=1)[:, None]
            p = tl.where(e_ok[None, :], p, -1.0)
            total = tl.full([BLOCK_T], 1.0, tl.float32)
            if RENORM:
                total = _topk_pass(p, e_range, TOPK, total, False, ids_ptr, wts_ptr, rt, t_ok)
            _topk_pass(p, e_range, TOPK, total, True, ids_ptr, wts_ptr, rt, t_ok)
    # the sentinel fill (every slot of the plan; padding keeps it)
    n_sorted = num_blocks * BLOCK_M
    for p0 in range(0, n_sorted, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ptr + offs, tl.full([BLOCK_P], 0, tl.int32) + num_pairs, mask=offs < n_sorted)
    tl.debug_barrier()  # ids written above / sentinels before the scatter below (other threads)

    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == e_range[None, :]).to(tl.int32), axis=0)
    counts = tl.where(e_ok, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(npad_ptr, tl.sum(padded, axis=0))
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        onehot = ((ids[:, None] == e_range[None, :]) & e_ok[None, :]).to(tl.int32)
        incl = tl.cumsum(onehot, axis=0)
        pos = tl.sum(onehot * (incl - 1 + running[None, :] + starts[None, :]), axis=1)
        ok = valid & (ids >= 0) & (ids < num_experts)
        tl.store(sorted_ptr + pos, offs, mask=ok)
        running += tl.sum(onehot, axis=0)
    blk_start = starts // BLOCK_M
    blk_end = ends // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_P):
        b = b0 + tl.arange(0, BLOCK_P)
        inside = (b[:, None] >= blk_start[None, :]) & (b[:, None] < blk_end[None, :])
        e_of_b = tl.sum(tl.where(inside, e_range[None, :] + 1, 0), axis=1) - 1
        tl.store(eob_ptr + b, e_of_b, mask=b < num_blocks)


def plan_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host-known number of plan blocks: ceil((P + E (BLOCK_M - 1)) / BLOCK_M)."""
    return cdiv(num_pairs + num_experts * (block_m - 1), block_m)


def route_plan(
    logits: torch.Tensor | None,  # [T, E] router logits, or x [T, H] with ``gate`` (None: ``topk_ids`` given)
    topk_ids: torch.Tensor,  # int32 [T*k] contiguous: output when routing, input otherwise
    topk_weights: torch.Tensor | None,  # fp32 [T*k]: output when routing
    sorted_ids: torch.Tensor,  # int32 [nb * block_m]
    expert_of_block: torch.Tensor,  # int32 [nb]
    num_padded: torch.Tensor,  # int32 [1]
    num_tokens: int,
    top_k: int,
    num_experts: int,
    block_m: int,
    renormalize: bool = True,
    gate: torch.Tensor | None = None,  # [E, H] router weight: ``logits`` is then x [T, H]
) -> None:
    """One launch: (optionally) route, then fill the sentinel and build the plan into the given buffers."""
    route = logits is not None
    e_pad = max(2, next_pow2(num_experts))
    block_t = (4 if gate is not None else 32) if num_experts <= 64 else 8
    _route_plan_kernel[(1,)](
        logits if route else topk_ids, logits.stride(0) if route else 0,
        gate if gate is not None else topk_ids, gate.stride(0) if gate is not None else 0,
        gate.shape[1] if gate is not None else 0,
        topk_ids, topk_weights if route else topk_ids,
        sorted_ids, expert_of_block, num_padded,
        num_tokens, num_tokens * top_k, num_experts, expert_of_block.shape[0],
        TOPK=top_k, ROUTE=route, GATE=gate is not None, RENORM=renormalize, E_PAD=e_pad,
        BLOCK_M=block_m, BLOCK_P=256 if num_experts <= 64 else 64, BLOCK_T=block_t,
        BLOCK_H=max(16, min(256, 4096 // e_pad)),
    )
