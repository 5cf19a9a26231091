"""GGUF Q4_0 experts into the AWQ format at load by moving packed words (engine side: the conversion runs moeflow's
CPU library, which :mod:`moeflow.io` may not import; the byte ranges and the unpacking reference are in
:mod:`moeflow.io.gguf.experts`)."""

from __future__ import annotations

import torch

from moeflow.io.gguf.experts import AWQ_ZERO_8, ExpertBytes, check_q4_0
from moeflow.kernels.cpu.native import library
from moeflow.kernels.repack import q4_0_to_awq


def q4_0_awq_expert_tensors(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4_0 experts as the AWQ format's tensors (group 32, zero point 8, scale ``d``), bit for bit the same weights:
    ``w13_qweight`` int32 [H, 2I/8] (gate columns, then up), ``w13_qzeros`` [H/32, 2I/8], ``w13_scales`` fp16
    [H/32, 2I]; ``w2_*`` likewise for down ([I, H/8], [I/32, H/8], [I/32, H]). The stored words are moved, not
    unpacked (:func:`moeflow.kernels.repack.q4_0_to_awq`; C where moeflow's CPU library builds);
    :func:`moeflow.io.gguf.experts.q4_0_awq_expert_tensors_reference` unpacks every code (the tests compare them)."""
    lib = library()
    out = {}
    for name, parts in (("w13", ("gate", "up")), ("w2", ("down",))):
        check_q4_0(expert, parts)
        rows = [raw[p].shape[0] for p in parts]
        n, k = sum(rows), expert.slices[parts[0]].shape[1]
        qweight = torch.empty(k, n // 8, dtype=torch.int32)
        scales = torch.empty(k // 32, n, dtype=torch.float16)
        at = 0
        for p, m in zip(parts, rows, strict=True):
            q4_0_to_awq(raw[p], qweight[:, at // 8:(at + m) // 8], scales[:, at:at + m], lib)
            at += m
        out[f"{name}_qweight"] = qweight
        out[f"{name}_qzeros"] = torch.full((k // 32, n // 8), AWQ_ZERO_8, dtype=torch.int32)
        out[f"{name}_scales"] = scales
    return out
