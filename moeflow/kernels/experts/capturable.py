"""The torch expert compute with static shapes: capturable as a CUDA graph (and by the tests' CPU recorder).

:func:`moeflow.kernels.experts.reference.expert_forward_pool_reference` gathers each selected expert's pairs
(``unique``, ``nonzero``, a host read of the slot): data-dependent shapes a graph cannot hold. Here every
expert of the table is computed for every token, its slot gathered on the device (``index_select``), and
its pairs selected with ``where``: the same numeric contract (fp32 accumulation, ``silu(gate) * up`` stored
in the activation dtype, the fp32 routing weight on the w2 product) at E times the work. It is what the
offload backend's captured device part runs when the kernels backend is ``"torch"`` (tests, CPU); the Triton
kernels are capturable as they are. :func:`static_biased_forward` is the same for the biased formats (gpt-oss:
biases, clamped SwiGLU; dense, AWQ, MXFP4) and GGUF, over a format's device-only dequantization of a slot
(:data:`StaticWeights`). The rows are close to the reference's, not bitwise: a GEMM over all T
rows may accumulate in another order than one over an expert's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeflow.kernels.experts.reference import pool_weights
from moeflow.kernels.formats.plain_layout import qweight_rows
from moeflow.kernels.pool import ExpertPool

if TYPE_CHECKING:
    from moeflow.kernels.formats.layout import ExpertFormat


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


# (W13 [2I, H] gate rows first, b13 [2I] | None, W2 [H, I], b2 [H] | None) of the expert in a slot given as an
# int32 [1] device tensor: fp32, or the pool's dtype where the format is dense in the activation dtype
StaticWeights = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]]


def static_biased_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    fmt: ExpertFormat,  # its gate epilogue (activation, alpha, limit) and dense_in
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor,  # bool [E]
    out: torch.Tensor,  # [T*k, H], rows of the selected experts' pairs written in place
    weights_of: StaticWeights,  # the format's device-only dequantization of a slot
) -> torch.Tensor:
    """:func:`moeflow.kernels.experts.biased.biased_expert_forward_reference` (biases, the format's gate
    activation; GGUF experts too) with static shapes and no host read, as :func:`static_expert_forward`: every
    expert of the table on every token, its pairs selected with ``where``. Same numeric contract as the
    reference (fp32 GEMMs and bias, the activation stored in the activation dtype; ``nn.Linear`` semantics for
    dense weights in the activation dtype)."""
    from moeflow.kernels.experts.biased import gate_activation

    T, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()[:, None]
    same_dtype_dense = fmt.dense_in(x.dtype)
    for e in range(slot_of_expert.shape[0]):
        w13, b13, w2, b2 = weights_of(slot_of_expert[e : e + 1])
        if same_dtype_dense:
            a = gate_activation(F.linear(x, w13, b13).float(), fmt).to(x.dtype)
            y = F.linear(a, w2, b2)
            y = y.unsqueeze(1).expand(T, k, -1).reshape(T * k, -1) * flat_w.to(x.dtype)
        else:
            h = x.float() @ w13.float().T
            a = gate_activation(h if b13 is None else h + b13.float(), fmt).to(x.dtype)
            y = a.float() @ w2.float().T
            y = y if b2 is None else y + b2.float()
            y = y.unsqueeze(1).expand(T, k, -1).reshape(T * k, -1) * flat_w
        chosen = (flat_ids == e) & expert_mask[e]
        out.copy_(torch.where(chosen[:, None], y.to(out.dtype), out))
    return out


def awq_static_weights(pool: ExpertPool, shifts: torch.Tensor) -> StaticWeights:
    """The biased AWQ format's :data:`StaticWeights`: the plain kernel layout dequantized on the device
    (``shifts`` from :func:`nibble_shifts`), w13's interleaved gate/up rows and bias put gate first."""
    fmt, t = pool.fmt, pool.tensors
    w13, w2 = ((t[f"{m}_qweight"], t[f"{m}_qzeros"], t[f"{m}_scales"]) for m in ("w13", "w2"))

    def weights_of(slot: torch.Tensor):
        g13 = _dequantize(w13, slot, fmt.group_size, shifts)  # [2I, H]: gate j, up j interleaved
        b13 = b2 = None
        if fmt.bias:
            b = t["w13_bias"].index_select(0, slot)[0].float()
            b13, b2 = torch.cat([b[0::2], b[1::2]]), t["w2_bias"].index_select(0, slot)[0].float()
        return torch.cat([g13[0::2], g13[1::2]]), b13, _dequantize(w2, slot, fmt.group_size, shifts), b2
    return weights_of
