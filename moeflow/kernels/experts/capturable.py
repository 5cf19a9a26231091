"""The torch expert compute with static shapes: capturable as a CUDA graph (and by the tests' CPU recorder).

:func:`moeflow.kernels.experts.reference.expert_forward_pool_reference` gathers each selected expert's pairs
(``unique``, ``nonzero``, a host read of the slot): data-dependent shapes a graph cannot hold. Here every
expert of the table is computed for every token, its slot gathered on the device (``index_select``), and
its pairs selected with ``where``: the same numeric contract (fp32 accumulation, ``silu(gate) * up`` stored
in the activation dtype, the fp32 routing weight on the w2 product) at E times the work. It is what the
offload backend's captured device part runs when the kernels backend is ``"torch"`` (tests, CPU); the Triton
kernels are capturable as they are. The rows are close to the reference's, not bitwise: a GEMM over all T
rows may accumulate in another order than one over an expert's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeflow.kernels.experts.reference import pool_weights
from moeflow.kernels.formats.plain_layout import qweight_rows
from moeflow.kernels.pool import ExpertPool


def nibble_shifts(device: torch.device) -> torch.Tensor:
    """int32 [8]: the bit offsets of the 8 nibbles of an int32 word (allocate once, outside a capture)."""
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def _dequantize(weights: tuple, slot: torch.Tensor, group_size: int, shifts: torch.Tensor) -> torch.Tensor:
    """fp32 W^T [N, K] of the matrix in ``slot`` (int32 [1], on the device): AWQ kernel layout
    (qweight [S, K/P, N, P/8], qzeros [S, K/g, N/8], scales [S, K/g, N]) or dense (w [S, N, K], None, None).
    Bitwise :func:`moeflow.kernels.experts.reference.dequantize_kernel_layout` with no host-side index."""
    qweight, qzeros, scales = weights
    if qzeros is None:
        return qweight.index_select(0, slot)[0].float()
    qw, qz, sc = (t.index_select(0, slot)[0] for t in (qweight, qzeros, scales))
    qw = qweight_rows(qw)  # [N, K/8]
    n, groups = qw.shape[0], qz.shape[0]
    q = ((qw.unsqueeze(-1) >> shifts) & 0xF).reshape(n, -1)  # [N, K]
    z = ((qz.unsqueeze(-1) >> shifts) & 0xF).reshape(groups, -1)  # [K/g, N]
    z = z.T.unsqueeze(-1).expand(n, groups, group_size).reshape(n, -1)
    s = sc.float().T.unsqueeze(-1).expand(n, groups, group_size).reshape(n, -1)
    return (q - z).float() * s


def static_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # slots [S, ...]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor,  # bool [E]
    out: torch.Tensor,  # [T*k, H], rows of the selected experts' pairs written in place
    shifts: torch.Tensor,  # int32 [8] from nibble_shifts
) -> torch.Tensor:
    """``moeflow.kernels.expert_forward`` (torch backend) with static shapes and no host read: rows of
    unselected experts keep their values. Slots of unselected experts must still be valid indices."""
    w13, w2, group = pool_weights(pool)
    T, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()[:, None]
    dense_same = w13[1] is None and w13[0].dtype == x.dtype
    for e in range(slot_of_expert.shape[0]):
        slot = slot_of_expert[e : e + 1]
        if dense_same:  # nn.Linear semantics, as the reference
            gate_up = F.linear(x, w13[0].index_select(0, slot)[0])
            a = F.silu(gate_up[:, 0::2]) * gate_up[:, 1::2]
            y = F.linear(a, w2[0].index_select(0, slot)[0])
            y = y.unsqueeze(1).expand(T, k, -1).reshape(T * k, -1) * flat_w.to(x.dtype)
        else:
            gate_up = x.float() @ _dequantize(w13, slot, group, shifts).T
            a = (F.silu(gate_up[:, 0::2]) * gate_up[:, 1::2]).to(x.dtype)
            y = a.float() @ _dequantize(w2, slot, group, shifts).T
            y = y.unsqueeze(1).expand(T, k, -1).reshape(T * k, -1) * flat_w
        chosen = (flat_ids == e) & expert_mask[e]
        out.copy_(torch.where(chosen[:, None], y.to(out.dtype), out))
    return out
