"""Expert compute: routing plan, grouped expert GEMMs reading a slot pool, and the combine.

``backend`` selects the implementation: ``"torch"`` (the reference in :mod:`.reference`) or
``"triton"`` (Triton kernels; on a CPU they run under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from moeflow.kernels.pool import ExpertFormat, ExpertPool
from moeflow.kernels.reference import combine_reference, expert_forward_reference

__all__ = ["ExpertFormat", "ExpertPool", "expert_forward", "combine", "moe_forward"]


def expert_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Fill ``out`` [T*k, H] with the routing-weighted outputs of the pairs whose expert is selected."""
    if backend != "torch":
        raise ValueError(f"kernels backend {backend!r} is not available yet")
    return expert_forward_reference(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)


def combine(y: torch.Tensor, top_k: int, backend: str = "torch") -> torch.Tensor:
    """[T*k, H] -> [T, H]: sum each token's k expert outputs (deterministic)."""
    return combine_reference(y, top_k)


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """All experts resident: plan, expert GEMMs and combine in one call. x [T, H] -> [T, H]."""
    out = torch.empty((topk_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, None, backend)
    return combine(out, topk_ids.shape[1], backend)
