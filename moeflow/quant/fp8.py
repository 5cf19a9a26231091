"""FP8 checkpoints with block scales, as DeepSeek-V3 / R1 / Kimi-K2 and MiniMax-M2 publish them, read as dense
weights.

config.json says ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`` (MiniMax-M2: ``"fmt": "float8_e4m3fn"``, and ``modules_to_not_convert`` naming
what is stored in 16 bits anyway). Each quantized linear weight ``W`` ``[N, K]`` is stored as ``float8_e4m3fn`` with
``<name>_scale_inv`` fp32 ``[ceil(N / bn), ceil(K / bk)]``: ``W[n, k] = q[n, k] * scale_inv[n // bn, k // bk]``.
Embeddings, norms, the router and the LM head stay in 16/32 bits.

moeflow never computes in FP8: :class:`Fp8BlockReader` hands every FP8 weight out dequantized (fp32), so the
non-expert weights load in the model's dtype, and the experts are requantized to the project's int4 (AWQ)
expert format with :func:`awq_expert_tensors` (at load, or by ``moeflow quantize``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeflow.errors import CheckpointError, UnsupportedQuantizationError
from moeflow.io.checkpoint import CheckpointReader
from moeflow.quant.awq import SUPPORTED_GROUP_SIZES, quantize_rtn

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0
FP8_FORMATS = ("e4m3", "float8_e4m3fn")  # config.json's "fmt": DeepSeek-V3 / Kimi-K2 write e4m3, MiniMax-M2 the other
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8BlockSpec:
    """config.json's FP8 quantization: the (rows, columns) of one scale block."""

    block: tuple[int, int] = (128, 128)


def fp8_block_spec(config: dict[str, Any], source: str | Path = "config.json") -> Fp8BlockSpec | None:
    """The FP8 block spec of config.json's ``quantization_config`` (None when it is not FP8)."""
    qc = config.get("quantization_config") or {}
    if str(qc.get("quant_method", "")).lower() != "fp8":
        return None
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt not in FP8_FORMATS:
        raise UnsupportedQuantizationError(f"{source}: FP8 format {qc.get('fmt')!r} is not supported "
                                           f"({' or '.join(FP8_FORMATS)})")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedQuantizationError(f"{source}: FP8 quantization_config needs weight_block_size [rows, cols] "
                                           f"(block scales); got {block!r}")
    return Fp8BlockSpec((int(block[0]), int(block[1])))


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight float8 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)] -> fp32 [N, K]."""
    n, k = weight.shape
    bn, bk = block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in {bn}x{bk} blocks "
                         f"needs {want}")
    if n % bn == 0 and k % bk == 0:  # whole blocks: the scale broadcast over each, no full-size scale tensor
        blocks = weight.float().view(n // bn, bn, k // bk, bk)
        return (blocks * scale_inv.float()[:, None, :, None]).view(n, k)
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * scale


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's converter does it: weight [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv
    [ceil(N/bn), ceil(K/bk)]) with each block's largest magnitude mapped to 448 (tests and tools)."""
    n, k = weight.shape
    bn, bk = block
    w = weight.float()
    padded = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
    padded[:n, :k] = w
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale_inv


class Fp8BlockReader:
    """A :class:`CheckpointReader` whose FP8 weights read as fp32 (dequantized with their block scales);
    the ``*_scale_inv`` tensors are consumed, not listed."""

    def __init__(self, reader: CheckpointReader, spec: Fp8BlockSpec):
        self.reader, self.spec = reader, spec
        self.directory = reader.directory
        self.weight_map = reader.weight_map

    def over(self, reader: CheckpointReader) -> Fp8BlockReader:
        """The same dequantization over another reader of the checkpoint's tensors (the disk tier's views)."""
        return Fp8BlockReader(reader, self.spec)

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if not n.endswith(SCALE_SUFFIX)]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.reader.get(name, shape)
        if t.dtype not in FP8_DTYPES:
            return t
        scale = name + SCALE_SUFFIX
        if scale not in self.reader:
            raise CheckpointError(f"tensor {name!r} is FP8 ({t.dtype}) but its block scales {scale!r} are missing "
                                  f"from the checkpoint in {self.directory}")
        try:
            return dequantize_fp8_block(t, self.reader.get(scale), self.spec.block)
        except ValueError as e:
            raise CheckpointError(f"tensor {scale!r}: {e}") from e

    def close(self) -> None:
        self.reader.close()


def int4_group_size(*sizes: int) -> int:
    """The largest AWQ group size dividing every input size (experts requantized from FP8)."""
    for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if all(s % g == 0 for s in sizes):
            return g
    raise CheckpointError(f"expert sizes {sizes} are not multiples of any AWQ group size {SUPPORTED_GROUP_SIZES}: "
                          "FP8 experts cannot be requantized to int4")


def awq_expert_tensors(w13: torch.Tensor, w2: torch.Tensor, group_size: int,
                       scales_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One dense expert (w13 [2I, H] gate rows first, w2 [H, I]) -> the AWQ expert tensors (``w13_qweight``
    int32 [H, 2I/8], ``w13_qzeros``, ``w13_scales`` [H/g, 2I], ``w2_*`` likewise), round-to-nearest."""
    out = {}
    for part, weight in (("w13", w13), ("w2", w2)):
        t = quantize_rtn(weight.float(), group_size)
        out.update({f"{part}_qweight": t.qweight, f"{part}_qzeros": t.qzeros,
                    f"{part}_scales": t.scales.to(scales_dtype)})
    return out
