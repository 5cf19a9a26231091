"""Compute of the biased expert formats (gpt-oss: biases, a gate activation, dense / AWQ / MXFP4 storage; the
formats themselves are :mod:`moeflow.kernels.formats.biased` and :mod:`moeflow.kernels.formats.mxfp4`): the
plain-torch reference, the biased AWQ Triton path, and the custom op ``BiasedExpertFormat.forward`` runs through.

Numerics (as the plain format's reference): GEMMs accumulate in fp32, the bias is added in fp32, the
activation is computed in fp32 and stored in the activation dtype; w2 + bias is multiplied by the fp32
routing weight and stored in the activation dtype. Dense weights in the activation dtype use ``F.linear``
(``nn.Linear`` semantics, as transformers computes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeflow.kernels.formats.layout import ExpertFormat
from moeflow.kernels.pool import ExpertPool

if TYPE_CHECKING:
    from moeflow.kernels.experts.ops import Alloc

__all__ = ["biased_awq_forward", "biased_expert_forward_reference", "gate_activation"]

def gate_activation(h: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """h fp32 [P, 2I] (gate columns first, then up) -> a fp32 [P, I]."""
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter], h[..., inter:]
    if fmt.activation == "silu":
        return F.silu(gate) * up
    limit, alpha = fmt.swiglu_limit, fmt.swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def biased_expert_forward_reference(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H], written for the pairs of selected experts only
    expert_mask: torch.Tensor | None = None,  # bool [E]
) -> torch.Tensor:
    """The plain-torch compute of a :class:`BiasedExpertFormat` pool (the contract of ``expert_forward``)."""
    fmt = pool.fmt
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    t = pool.tensors
    same_dtype_dense = fmt.dense_in(x.dtype)
    for e in torch.unique(flat_ids).tolist():
        if expert_mask is not None and not bool(expert_mask[e]):
            continue
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        rows = x[pairs // k]
        s = int(slot_of_expert[e])
        if same_dtype_dense:  # nn.Linear semantics in the activation dtype, like the transformers model
            b13 = t["w13_bias"][s] if fmt.bias else None
            b2 = t["w2_bias"][s] if fmt.bias else None
            a = gate_activation(F.linear(rows, t["w13"][s], b13).float(), fmt).to(x.dtype)
            y = F.linear(a, t["w2"][s], b2) * flat_w[pairs, None].to(x.dtype)
        else:
            w13, b13, w2, b2 = fmt.reference_weights(pool, s)
            h = rows.float() @ w13.T
            a = gate_activation(h if b13 is None else h + b13, fmt).to(x.dtype)
            y = a.float() @ w2.T
            y = (y if b2 is None else y + b2) * flat_w[pairs, None]
        out[pairs] = y.to(out.dtype)
    return out


def biased_awq_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # a BiasedAWQFormat pool (the plain format's kernel layout + biases)
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None = None,  # bool [E]
    *,
    config: dict | None = None,
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Biased AWQ experts through the grouped AWQ Triton kernels: plan, w13 with ``+ bias`` and the format's
    activation in the epilogue, w2 with ``+ bias`` times the routing weight (``config``: ``{"BLOCK_M", "w13":
    {...}, "w2": {...}}`` overriding the heuristic defaults, ``SPLIT_K`` included: the in-kernel fixup sums the
    splits and adds the bias once, after the sum). ``alloc``: the plan, ``h`` and the split-K partials in the
    caller's persistent buffers (static shapes, no allocation: what a captured CUDA graph runs)."""
    from moeflow.kernels.experts import configs
    from moeflow.kernels.experts.gemm import expert_gemm
    from moeflow.kernels.experts.ops import plan_and_hidden, split_k_partials

    fmt, t = pool.fmt, pool.tensors
    T, top_k = topk_ids.shape
    num_pairs, num_experts = T * top_k, slot_of_expert.shape[0]
    g, inter = fmt.group_size, fmt.intermediate_size
    cfg = configs.default_config("moe", T, num_experts, top_k, inter, fmt.hidden_size, g)
    config = config or {}
    block_m = int(config.get("BLOCK_M", cfg["BLOCK_M"]))
    stage = {name: {**cfg[name], **config.get(name, {}), "BLOCK_M": block_m} for name in ("w13", "w2")}
    act = dict(activation=fmt.activation, alpha=fmt.swiglu_alpha, limit=fmt.swiglu_limit)
    ws = {}
    sorted_ids, expert_of_block, h = plan_and_hidden(x, topk_ids, num_experts, block_m, inter, alloc)
    if alloc is not None:  # (without: expert_gemm takes its partials from the shared scratch buffer)
        for mode, (name, n) in enumerate((("w13", 2 * inter), ("w2", out.shape[1]))):
            split = int(stage[name].get("SPLIT_K", 1))
            if split > 1:
                ws[name] = split_k_partials((split, num_pairs, n), mode, x.device, alloc)
    expert_gemm(0, x, (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]), h, sorted_ids, expert_of_block,
                slot_of_expert, expert_mask, None, num_pairs, top_k, g, stage["w13"],
                bias=t["w13_bias"] if fmt.bias else None, ws=ws.get("w13"), **act)
    w = topk_weights.reshape(-1).float().contiguous()
    expert_gemm(1, h, (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"]), out, sorted_ids, expert_of_block,
                slot_of_expert, expert_mask, w, num_pairs, 1, g, stage["w2"], bias=t["w2_bias"] if fmt.bias else None,
                ws=ws.get("w2"))
    return out
