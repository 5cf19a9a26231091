"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel layout, as Qwen publishes ``*-GPTQ-Int4``), converted at load
into the AWQ GEMM layout the kernels read (:mod:`moeflow.quant.awq`).

For a linear layer with ``in_features`` K and ``out_features`` N, group size g:

* ``qweight`` int32 ``[K / 8, N]``: packed along the *input* dimension; nibble ``i`` (bits ``4i..4i+3``) of
  word ``[r, n]`` holds ``q[8r + i, n]``;
* ``qzeros``  int32 ``[K / g, N / 8]``: packed along the output dimension in plain order (nibble ``i`` holds
  column ``8c + i``); the ``gptq`` (v1) checkpoint format stores ``zero - 1``, ``gptq_v2`` the zero itself;
* ``scales``  fp16 ``[K / g, N]``; ``g_idx`` int32 ``[K]``: the group of each input row;
* ``W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``, ``y = x @ W``.

With ``desc_act=false`` (no act-order) ``g_idx[k] = k // g``, so the weight is exactly an AWQ weight: the
same ``W = (q - z) * s`` with contiguous groups, only packed differently. Act-order checkpoints
(``desc_act=true``) permute the groups and are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from moeflow.errors import UnsupportedQuantizationError
from moeflow.quant.awq import PACK, SUPPORTED_GROUP_SIZES, pack_int4

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i sits at bits 4i..4i+3
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # what the checkpoint format adds to a stored zero point


def gptq_settings(qc: dict[str, Any], source: str) -> tuple[int, int]:
    """(group_size, zero offset) of a GPTQ ``quantization_config``; UnsupportedQuantizationError naming the setting
    otherwise. Readable: 4 bits, symmetric, ``desc_act=false``, a group size AWQ's kernels take."""
    bits = qc.get("bits")
    if bits != 4:
        raise UnsupportedQuantizationError(f"{source}: GPTQ with bits={bits} is not supported (only 4-bit)")
    if qc.get("desc_act", False):
        raise UnsupportedQuantizationError(
            f"{source}: GPTQ with desc_act=true (act-order) is not supported: its g_idx permutes the quantization "
            "groups, which the int4 kernels cannot follow; use a checkpoint quantized with desc_act=false")
    if not qc.get("sym", True):
        raise UnsupportedQuantizationError(f"{source}: GPTQ with sym=false is not supported (only symmetric)")
    group = qc.get("group_size")
    if group not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedQuantizationError(
            f"{source}: GPTQ group_size={group} is not supported (supported: {SUPPORTED_GROUP_SIZES})")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ZERO_OFFSET:
        raise UnsupportedQuantizationError(
            f"{source}: GPTQ checkpoint_format={qc.get('checkpoint_format')!r} is not supported "
            f"(supported: {', '.join(ZERO_OFFSET)})")
    return int(group), ZERO_OFFSET[fmt]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 8]: nibble i of each word at index i (values 0..15)."""
    return (packed.unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 ``[K/8, N]`` -> int32 ``[K, N]`` (q in 0..15)."""
    rows, n = qweight.shape
    return _nibbles(qweight).permute(0, 2, 1).reshape(rows * PACK, n)


def unpack_gptq_qzeros(qzeros: torch.Tensor, offset: int) -> torch.Tensor:
    """int32 ``[G, N/8]`` -> the zero points int32 ``[G, N]`` (stored value + ``offset``)."""
    groups, words = qzeros.shape
    return _nibbles(qzeros).reshape(groups, words * PACK) + offset


def gptq_qweight_to_awq(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` int32 ``[K/8, N]`` -> AWQ ``qweight`` int32 ``[K, N/8]`` holding the same q."""
    return pack_int4(unpack_gptq_qweight(qweight))


def gptq_qzeros_to_awq(qzeros: torch.Tensor, offset: int, name: str = "qzeros") -> torch.Tensor:
    """GPTQ ``qzeros`` int32 ``[G, N/8]`` -> AWQ ``qzeros`` int32 ``[G, N/8]`` holding the same zero points."""
    zeros = unpack_gptq_qzeros(qzeros, offset)
    # a v1 checkpoint whose stored zero wrapped (zero point 0 stored as -1); meta: the expert index recording
    if zeros.device.type != "meta" and int(zeros.max()) > 15:
        raise UnsupportedQuantizationError(f"{name}: a zero point of 16 after the GPTQ v1 offset does not fit 4 bits")
    return pack_int4(zeros)


def check_sequential_groups(g_idx: torch.Tensor, group_size: int, name: str) -> None:
    """``g_idx`` int32 [K] must be ``k // group_size`` (no act-order), else UnsupportedQuantizationError."""
    if g_idx.device.type == "meta":  # the expert index recording which tensors an expert reads: checked on reads
        return
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if not torch.equal(g_idx.long(), want):
        raise UnsupportedQuantizationError(
            f"{name}: g_idx is not k // group_size={group_size}: the tensor was quantized with act-order "
            "(desc_act=true), which is not supported")
