"""GGUF (ggml) weight blocks: the block types moeflow's GGUF experts run (with the kernels' selector codes), and
their exact fp32 dequantization in plain torch (the reference every GGUF kernel is checked against:
:func:`moeflow.quant.ggml.dequantize`, the GGUF reader's, checked bit for bit against gguf-py's
``gguf.quants.dequantize`` and ggml's C loops in the tests).

A quantized ggml matrix ``[N, K]`` (llama.cpp's ``ne = (K, N)``: a row is one output feature, its K inputs
contiguous) stores each row as ``K / QK`` blocks of ``type_size`` bytes, rows one after the other. The block
layouts (ggml-common.h; all fp16 fields little-endian):

* ``Q8_0`` (QK 32, 34 bytes): ``d`` fp16, ``qs`` int8[32]; ``w = qs * d``.
* ``Q4_0`` (QK 32, 18 bytes): ``d`` fp16, ``qs`` uint8[16]; element ``j < 16`` is ``qs[j] & 15``, element
  ``j + 16`` is ``qs[j] >> 4``; ``w = d * (q - 8)``.
* ``Q4_1`` (QK 32, 20 bytes): ``d``, ``m`` fp16, ``qs`` [16] as Q4_0; ``w = d * q + m``.
* ``Q5_0`` (QK 32, 22 bytes): ``d`` fp16, ``qh`` uint32 (bit ``j``: bit 4 of element ``j``), ``qs`` [16] as Q4_0;
  ``w = d * (q - 16)``. ``Q5_1`` (24 bytes): ``d``, ``m``, ``qh``, ``qs``; ``w = d * q + m``. (llama-quantize falls
  back to these for K-quant tensors whose rows are not a multiple of 256.)
* ``Q4_K`` (QK 256, 144 bytes): ``d``, ``dmin`` fp16, ``scales`` [12] (eight 6-bit scales ``sc`` and mins ``m``,
  llama.cpp's ``get_scale_min_k4``), ``qs`` [128]: 64-element chunk ``c`` is bytes ``32c .. 32c + 31``, low nibbles
  its first 32 elements (sub-block ``2c``), high nibbles the next 32; ``w = (d sc) q - dmin m``.
* ``Q5_K`` (QK 256, 176 bytes): ``d``, ``dmin``, ``scales`` [12] as Q4_K, ``qh`` [32], ``qs`` [128] as Q4_K; bit
  ``j`` of ``qh[l]`` is bit 4 of element ``32 j + l``; ``w = (d sc) q - dmin m``.
* ``Q6_K`` (QK 256, 210 bytes): ``ql`` [128], ``qh`` [64], ``scales`` int8[16], ``d`` fp16. Element ``p = 128 n +
  32 g + l`` (half n, quarter g, l < 32): low 4 bits ``ql[64 n + 32 (g % 2) + l] >> 4 (g // 2)``, high 2 bits
  ``qh[32 n + l] >> 2 g``, ``q - 32`` times ``d * scales[p // 16]``.

(The layouts above are what the kernels decode; the arithmetic order of the reference is gguf-py's and llama.cpp's
``dequantize_row_*``, so the fp32 values are the same bits.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGMLType:
    """One ggml block type: its name and id (``gguf.GGMLQuantizationType``), elements and bytes per block."""

    name: str
    type_id: int
    block_size: int  # elements per block (QK)
    type_size: int  # bytes per block
    code: int  # the Triton kernels' constexpr selector

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` elements (``k`` a multiple of ``block_size``)."""
        return k // self.block_size * self.type_size


QK_K = 256
# the types GGUF experts can be stored in here; ids and sizes as ggml.h / gguf-py's GGML_QUANT_SIZES
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("Q4_0", 2, 32, 18, 0), GGMLType("Q8_0", 8, 32, 34, 1), GGMLType("Q4_K", 12, QK_K, 144, 2),
    GGMLType("Q5_K", 13, QK_K, 176, 3), GGMLType("Q6_K", 14, QK_K, 210, 4), GGMLType("Q4_1", 3, 32, 20, 5),
    GGMLType("Q5_0", 6, 32, 22, 6), GGMLType("Q5_1", 7, 32, 24, 7),
)}


def ggml_type(t: str | int) -> GGMLType:
    """The block type named ``t`` (``"Q4_K"``, any case) or with ggml id ``t`` (an int or a
    ``gguf.GGMLQuantizationType``); a ValueError names the supported types."""
    if isinstance(t, int):
        found = [g for g in GGML_TYPES.values() if g.type_id == int(t)]
        if found:
            return found[0]
    elif isinstance(t, str) and t.upper() in GGML_TYPES:
        return GGML_TYPES[t.upper()]
    supported = ", ".join(f"{g.name} (id {g.type_id})" for g in GGML_TYPES.values())
    raise ValueError(f"unsupported GGUF expert weight type {t!r}: supported are {supported}")


def dequantize(data: torch.Tensor, t: str | int) -> torch.Tensor:
    """Exact fp32 values of ggml blocks: ``data`` uint8 ``[N, K / QK * type_size]`` (N rows) -> ``[N, K]``."""
    g = ggml_type(t)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % g.type_size:
        raise ValueError(f"{g.name} data must be uint8 [rows, blocks * {g.type_size}], got {data.dtype} "
                         f"{tuple(data.shape)}")
    from moeflow.quant.ggml import dequantize as ggml_dequantize

    return ggml_dequantize(data, g.type_id, f"{g.name} blocks")
