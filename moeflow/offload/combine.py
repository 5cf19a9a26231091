"""The offload backend's eager combine: plain torch, no ``torch.library`` custom-op dispatch (issue 14)."""

from __future__ import annotations

import torch


def combine_in_order(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [T*k, H] -> [T, H]: each token's k rows summed in fp32 in k order, cast back to y's dtype; bitwise
    :func:`moeflow.kernels.experts.reference.combine_reference` (the resident path's torch combine) in fewer ops,
    called directly in eager mode instead of through its ``torch.library`` custom op (~50 us a call)."""
    if top_k == 1:
        return y.clone()  # a copy: never alias the slot output buffer
    rows = y.view(-1, top_k, y.shape[-1]).unbind(1)  # row j of every token, [T, H] each (one call for the k views)
    if y.dtype == torch.float32:
        acc = torch.add(rows[0], rows[1])
    else:
        acc = torch.add(rows[0].float(), rows[1])  # rows[1] promoted to fp32 inside the add, exactly
    for j in range(2, top_k):
        acc += rows[j]
    return acc if y.dtype == torch.float32 else acc.to(y.dtype)
