"""Unquantized experts (bf16 / fp16 / fp32 checkpoints), in the plain kernel layout (:mod:`.plain_layout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.formats.plain import KernelWeights, PlainFormat

if TYPE_CHECKING:
    from moeflow.kernels.formats.layout import ExpertPool, ReferenceWeights


@dataclass(frozen=True)
class DenseFormat(PlainFormat):
    """``w13`` ``[2I, H]`` (gate and up rows interleaved in the region) and ``w2`` ``[H, I]`` in ``dtype``."""

    kind: ClassVar[str] = "dense"
    w13_halves: ClassVar[bool] = True

    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, self.dtype, shape) for name, shape in self.loader_shapes().items()]

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        return {"w13": (2 * I, H), "w2": (H, I)}

    def kernel_weights(self, pool: ExpertPool) -> KernelWeights:
        return (pool.tensors["w13"], None, None), (pool.tensors["w2"], None, None), 0

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        src = self.loader_tensors(pool.buffer[slot])
        return src["w13"].float(), None, src["w2"].float(), None

    def dense_in(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype
