"""Plain-torch reference implementation of the MoE expert compute. Every kernel is checked against it.

Numerics (the contract every backend follows):
* routing plan: the (token, k) pairs sorted by expert (stable), each expert's run padded to ``block_m``
  with the sentinel ``T * k``.
* w13 GEMM accumulates in fp32; ``silu(gate) * up`` is computed in fp32 and stored in the activation dtype.
* w2 GEMM accumulates in fp32, is multiplied by the fp32 routing weight, stored in the activation dtype.
* combine sums each token's k rows in fp32, in k order, and stores in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeflow.kernels.pool import ExpertPool
from moeflow.quant.awq import dequantize


def plan_size_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host-known upper bound on the padded length of a routing plan (no device sync needed)."""
    return num_pairs + num_experts * (block_m - 1)


def routing_plan_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align-block-size plan.

    topk_ids: int [T, k]. Returns
      sorted_ids      int32 [bound]: index into the flattened [T*k] pairs, sentinel T*k in padding/tail
      expert_of_block int32 [bound // block_m (ceil)]: expert of each block, -1 past the padded count
      num_padded      int32 [1]: number of valid entries of sorted_ids (a multiple of block_m)
    """
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)
    bound = plan_size_bound(num_pairs, num_experts, block_m)
    n_blocks = (bound + block_m - 1) // block_m
    device = topk_ids.device
    sorted_ids = torch.full((n_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_of_block = torch.full((n_blocks,), -1, dtype=torch.int32, device=device)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    n_expert_blocks = padded // block_m
    for_blocks = torch.repeat_interleave(torch.arange(num_experts, device=device), n_expert_blocks)
    expert_of_block[: for_blocks.numel()] = for_blocks.to(torch.int32)
    num_padded = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_of_block, num_padded


def expert_weights_reference(pool: ExpertPool, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 (w13 [H, 2I], w2 [I, H]) of the expert in ``slot`` (``y = x @ W`` orientation)."""
    t, fmt = pool.tensors, pool.fmt
    if fmt.kind == "dense":
        return t["w13"][slot].float().T, t["w2"][slot].float().T
    g = fmt.group_size
    w13 = dequantize(t["w13_qweight"][slot], t["w13_qzeros"][slot], t["w13_scales"][slot].float(), g)
    w2 = dequantize(t["w2_qweight"][slot], t["w2_qzeros"][slot], t["w2_scales"][slot].float(), g)
    return w13, w2


def expert_forward_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute the weighted expert outputs of every (token, k) pair whose expert is in ``expert_mask``.

    x [T, H]; topk_ids int [T, k]; topk_weights fp32 [T, k]; slot_of_expert int32 [E];
    out [T*k, H] (activation dtype) is written in place for the selected pairs only; expert_mask bool [E].
    """
    k = topk_ids.shape[1]
    inter = pool.fmt.intermediate_size
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    experts = torch.unique(flat_ids).tolist()
    for e in experts:
        if expert_mask is not None and not bool(expert_mask[e]):
            continue
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        rows = x[pairs // k]
        w13, w2 = expert_weights_reference(pool, int(slot_of_expert[e]))
        if pool.fmt.kind == "dense" and x.dtype == pool.fmt.dtype:
            # dense weights in the activation dtype: nn.Linear semantics, like the transformers model
            t = pool.tensors
            s = int(slot_of_expert[e])
            h = F.linear(rows, t["w13"][s])
            a = F.silu(h[:, :inter]) * h[:, inter:]
            y = F.linear(a, t["w2"][s]) * flat_w[pairs, None].to(x.dtype)
        else:
            h = rows.float() @ w13
            a = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
            y = (a.float() @ w2) * flat_w[pairs, None]
        out[pairs] = y.to(out.dtype)
    return out


def _expert_rows(
    sorted_ids: torch.Tensor, expert_of_block: torch.Tensor, num_pairs: int, expert_mask: torch.Tensor | None
) -> list[tuple[int, torch.Tensor]]:
    """(expert, pair indices in plan order) for every expert of the plan that ``expert_mask`` selects."""
    block_m = sorted_ids.numel() // max(1, expert_of_block.numel())
    out = []
    for e in torch.unique(expert_of_block[expert_of_block >= 0]).tolist():
        if expert_mask is not None and not bool(expert_mask[e]):
            continue
        blocks = torch.nonzero(expert_of_block == e).squeeze(1).to(torch.int64)
        pos = (blocks[:, None] * block_m + torch.arange(block_m, device=blocks.device)).reshape(-1)
        pairs = sorted_ids[pos].to(torch.int64)
        out.append((int(e), pairs[pairs < num_pairs]))
    return out


def _weight_of_slot(
    weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], slot: int, group_size: int
) -> torch.Tensor:
    """fp32 W [K, N] (``y = x @ W``) of one slot: AWQ (qweight, qzeros, scales) or dense (w [S, N, K], None, None)."""
    qweight, qzeros, scales = weights
    if qzeros is None:
        return qweight[slot].float().T
    return dequantize(qweight[slot], qzeros[slot], scales[slot].float(), group_size)


def w13_stage_reference(
    x: torch.Tensor,  # [T, H]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    top_k: int,
    weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],  # w13 pool views [S, ...]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    group_size: int,
    h: torch.Tensor,  # [T*k, I] written in place for the selected pairs
) -> torch.Tensor:
    """Plan-driven w13 GEMM + ``silu(gate) * up`` (the stage the Triton w13 kernel computes)."""
    inter = h.shape[1]
    dense_same = weights[1] is None and weights[0].dtype == x.dtype
    for e, pairs in _expert_rows(sorted_ids, expert_of_block, h.shape[0], expert_mask):
        rows = x[pairs // top_k]
        s = int(slot_of_expert[e])
        if dense_same:
            g = F.linear(rows, weights[0][s])
            h[pairs] = (F.silu(g[:, :inter]) * g[:, inter:]).to(h.dtype)
        else:
            g = rows.float() @ _weight_of_slot(weights, s, group_size)
            h[pairs] = (F.silu(g[:, :inter]) * g[:, inter:]).to(h.dtype)
    return h


def w2_stage_reference(
    h: torch.Tensor,  # [P, I]
    sorted_ids: torch.Tensor,  # int32 [n_blocks * block_m]
    expert_of_block: torch.Tensor,  # int32 [n_blocks]
    topk_weights: torch.Tensor | None,  # fp32 [P] or None (no routing weight)
    weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],  # w2 pool views [S, ...]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    group_size: int,
    out: torch.Tensor,  # [P, H] written in place for the selected pairs
) -> torch.Tensor:
    """Plan-driven w2 GEMM times the fp32 routing weight (the stage the Triton w2 kernel computes)."""
    dense_same = weights[1] is None and weights[0].dtype == h.dtype
    for e, pairs in _expert_rows(sorted_ids, expert_of_block, out.shape[0], expert_mask):
        a = h[pairs]
        s = int(slot_of_expert[e])
        if dense_same:
            y = F.linear(a, weights[0][s])
            if topk_weights is not None:
                y = y * topk_weights[pairs, None].to(h.dtype)
        else:
            y = a.float() @ _weight_of_slot(weights, s, group_size)
            if topk_weights is not None:
                y = y * topk_weights[pairs, None].float()
        out[pairs] = y.to(out.dtype)
    return out


def awq_linear_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/g, N/8]
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
) -> torch.Tensor:
    """Dense W4A16 matmul ``x @ W`` with fp32 accumulation, stored in x's dtype: [M, K] -> [M, N]."""
    return (x.float() @ dequantize(qweight, qzeros, scales.float(), group_size)).to(x.dtype)


def combine_reference(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sum each token's k weighted expert outputs: y [T*k, H] -> [T, H], fp32 sum in k order."""
    y3 = y.reshape(-1, top_k, y.shape[-1])
    acc = y3[:, 0].to(torch.float32, copy=True)  # a copy: never alias the input (k = 1, fp32)
    for j in range(1, top_k):
        acc = acc + y3[:, j].float()
    return acc.to(y.dtype)
