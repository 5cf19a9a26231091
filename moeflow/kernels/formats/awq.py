"""AWQ 4-bit experts (``quant_method: awq`` / GEMM-packed GPTQ / compressed-tensors pack-quantized), in the plain
kernel layout (:mod:`.plain_layout`): qweight in K panels, zeros and scales as published."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.formats.plain import KernelWeights, PlainFormat
from moeflow.kernels.formats.plain_layout import awq_panel

if TYPE_CHECKING:
    from moeflow.kernels.formats.layout import ExpertPool, ReferenceWeights


@dataclass(frozen=True)
class AWQFormat(PlainFormat):
    """``dtype`` is the scales' dtype; ``group_size`` AWQ's group (it sets the qweight panel)."""

    kind: ClassVar[str] = "awq"
    cpu_int4: ClassVar[bool] = True

    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size  # noqa: E741
        if g is None or H % g or I % g or H % 8 or I % 8:
            raise ValueError(
                f"AWQ expert format needs hidden ({H}) and intermediate ({I}) sizes divisible by "
                f"the group size ({g}) and by 8"
            )
        p = awq_panel(g)
        return [
            ("w13_qweight", torch.int32, (H // p, 2 * I, p // 8)),
            ("w13_qzeros", torch.int32, (H // g, 2 * I // 8)),
            ("w13_scales", self.dtype, (H // g, 2 * I)),
            ("w2_qweight", torch.int32, (I // p, H, p // 8)),
            ("w2_qzeros", torch.int32, (I // g, H // 8)),
            ("w2_scales", self.dtype, (I // g, H)),
        ]

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size  # noqa: E741
        return {"w13_qweight": (H, 2 * I // 8), "w13_qzeros": (H // g, 2 * I // 8), "w13_scales": (H // g, 2 * I),
                "w2_qweight": (I, H // 8), "w2_qzeros": (I // g, H // 8), "w2_scales": (I // g, H)}

    def kernel_weights(self, pool: ExpertPool) -> KernelWeights:
        t = pool.tensors
        return ((t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]),
                (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"]), self.group_size)

    def check_pool(self, pool: ExpertPool) -> None:
        from moeflow.kernels.experts.checks import check_pool_weights

        t, S, g = pool.tensors, pool.n_slots, self.group_size
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        check_pool_weights(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], g, H, 2 * I, "pool.w13_", S)
        check_pool_weights(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], g, I, H, "pool.w2_", S)

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        """From AWQ as published (so the reference also checks the layout conversion)."""
        from moeflow.quant.awq import dequantize

        src, g = self.loader_tensors(pool.buffer[slot]), self.group_size
        w13 = dequantize(src["w13_qweight"], src["w13_qzeros"], src["w13_scales"].float(), g)
        w2 = dequantize(src["w2_qweight"], src["w2_qzeros"], src["w2_scales"].float(), g)
        return w13.T, None, w2.T, None

    def cpu_unsupported(self) -> str | None:
        return None

    def cpu_expert(self, tensors: dict[str, torch.Tensor]):  # -> Int4Expert
        from moeflow.kernels.cpu.int4 import Int4Expert

        return Int4Expert.from_awq_tensors(tensors, self.group_size)
