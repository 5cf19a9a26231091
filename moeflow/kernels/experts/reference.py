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

from moeflow.kernels.formats.plain_layout import qweight_rows
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


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: logits [T, E] -> (topk_ids int32 [T, k], topk_weights fp32 [T, k]); softmax in fp32,
    top-k, then (``renormalize``) the k weights divided by their sum."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), w


def dequantize_kernel_layout(
    qweight: torch.Tensor,  # int32 [K/P, N, P/8] (pool kernel layout, one slot)
    qzeros: torch.Tensor,  # int32 [K/g, N/8]
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
) -> torch.Tensor:
    """fp32 W^T [N, K] (``nn.Linear`` orientation) of one matrix in the pool's kernel layout: (q - z) * s."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    qweight = qweight_rows(qweight)  # [N, K/8]
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(qweight.shape[0], -1)  # [N, K]
    z = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).reshape(qzeros.shape[0], -1)  # [K/g, N]
    z = z.T.repeat_interleave(group_size, dim=1)
    s = scales.float().T.repeat_interleave(group_size, dim=1)
    return (q - z).float() * s


def _weight_t(weights: tuple, slot: int, group_size: int) -> torch.Tensor:
    """fp32 W^T [N, K] of one slot: AWQ kernel layout (qweight, qzeros, scales) or dense (w [S, N, K], None, None)."""
    qweight, qzeros, scales = weights
    if qzeros is None:
        return qweight[slot].float()
    return dequantize_kernel_layout(qweight[slot], qzeros[slot], scales[slot], group_size)


def _selected_experts(topk_ids: torch.Tensor, expert_mask: torch.Tensor | None):
    """(expert, pair indices [n]) of every expert in ``topk_ids`` [T, k] that ``expert_mask`` selects."""
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        if expert_mask is None or bool(expert_mask[e]):
            yield e, torch.nonzero(flat_ids == e).squeeze(1)


def _gate_up(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of a w13 product in the pool's interleaved order -> (gate, up)."""
    return h[:, 0::2], h[:, 1::2]


def expert_forward_pool_reference(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # float [T, k]
    w13: tuple,  # pool views (qweight, qzeros, scales) [S, ...] or (w13 [S, 2I, H], None, None); interleaved
    w2: tuple,  # pool views, or (w2 [S, H, I], None, None)
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    group_size: int,
    out: torch.Tensor,  # [T*k, H], written in place for the pairs of selected experts only
) -> torch.Tensor:
    """The torch backend of ``expert_forward``: each selected expert's pairs, per the numeric contract."""
    k = topk_ids.shape[1]
    flat_w = topk_weights.reshape(-1).float()
    dense_same = w13[1] is None and w13[0].dtype == x.dtype
    for e, pairs in _selected_experts(topk_ids, expert_mask):
        rows = x[pairs // k]
        s = int(slot_of_expert[e])
        if dense_same:
            # dense weights in the activation dtype: nn.Linear semantics, like the transformers model
            gate, up = _gate_up(F.linear(rows, w13[0][s]))
            y = F.linear(F.silu(gate) * up, w2[0][s]) * flat_w[pairs, None].to(x.dtype)
        else:
            gate, up = _gate_up(rows.float() @ _weight_t(w13, s, group_size).T)
            a = (F.silu(gate) * up).to(x.dtype)
            y = (a.float() @ _weight_t(w2, s, group_size).T) * flat_w[pairs, None]
        out[pairs] = y.to(out.dtype)
    return out


def pool_weights(pool: ExpertPool) -> tuple[tuple, tuple, int]:
    """(w13, w2, group_size) views of a plain-format (dense or AWQ) pool as the plain kernels take them."""
    return pool.fmt.kernel_weights(pool)


def expert_weights_reference(pool: ExpertPool, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 (w13 [H, 2I] gate columns first, w2 [I, H]) of the expert in ``slot`` (``y = x @ W``),
    from the loader form (AWQ as published): independent of the kernel layout."""
    w13, _, w2, _ = pool.fmt.reference_weights(pool, slot)
    return w13.T, w2.T


def expert_forward_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: weighted expert outputs of every (token, k) pair whose expert is in ``expert_mask``,
    computed from the published AWQ form (so it also checks the layout conversion).

    x [T, H]; topk_ids int [T, k]; topk_weights fp32 [T, k]; slot_of_expert int32 [E];
    out [T*k, H] (activation dtype) is written in place for the selected pairs only; expert_mask bool [E].
    """
    k = topk_ids.shape[1]
    inter = pool.fmt.intermediate_size
    flat_w = topk_weights.reshape(-1).float()
    for e, pairs in _selected_experts(topk_ids, expert_mask):
        rows = x[pairs // k]
        s = int(slot_of_expert[e])
        if pool.fmt.dense_in(x.dtype):
            src = pool.fmt.loader_tensors(pool.buffer[s])
            h = F.linear(rows, src["w13"])
            y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], src["w2"]) * flat_w[pairs, None].to(x.dtype)
        else:
            w13, w2 = expert_weights_reference(pool, s)
            h = rows.float() @ w13
            a = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
            y = (a.float() @ w2) * flat_w[pairs, None]
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


def combine_partials_reference(partials: torch.Tensor, topk_weights: torch.Tensor, top_k: int,
                               dtype: torch.dtype) -> torch.Tensor:
    """The combine fused with the w2 split-K reduction: partials fp32 [S, T*k, H] summed in split order, times
    the fp32 weight, rounded to ``dtype`` (what w2 would store), then :func:`combine_reference`."""
    acc = partials[0].clone()
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s]
    return combine_reference((acc * topk_weights.reshape(-1, 1).float()).to(dtype), top_k)


def combine_reference(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sum each token's k weighted expert outputs: y [T*k, H] -> [T, H], fp32 sum in k order."""
    y3 = y.reshape(-1, top_k, y.shape[-1])
    acc = y3[:, 0].to(torch.float32, copy=True)  # a copy: never alias the input (k = 1, fp32)
    for j in range(1, top_k):
        acc = acc + y3[:, j].float()
    return acc.to(y.dtype)
