"""What the dense and AWQ formats share: the plain kernel layout (:mod:`.plain_layout`), the fused Triton MoE
and CUDA-graph capture that read it, and the conversion in and out of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moeflow.kernels.formats.layout import ExpertFormat
from moeflow.kernels.formats.plain_layout import from_kernel_layout, write_kernel_layout

# (w13, w2, group_size): the views the plain kernels take, each (qweight, qzeros, scales) [S, ...] or, dense,
# (w [S, N, K], None, None)
KernelWeights = tuple[tuple, tuple, int]


@dataclass(frozen=True)
class PlainFormat(ExpertFormat):
    """A format the plain expert kernels read (``moeflow.kernels.expert_forward``'s own path): SiLU-gated, no
    biases, w13's gate and up columns interleaved."""

    fused_moe: ClassVar[bool] = True
    capturable: ClassVar[bool] = True

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's loader-form tensors into the kernel layout in its region ``uint8 [nbytes]``.

        Checks names, shapes and dtypes (int32 for packed AWQ tensors); see :mod:`.plain_layout` for both forms.
        """
        views = self.views(region.view(1, -1))
        want = self.loader_shapes()
        for name, shape in want.items():
            if name not in tensors:
                raise KeyError(f"missing expert tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"expert tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            if (name.endswith("qweight") or name.endswith("qzeros")) and t.dtype != torch.int32:
                raise ValueError(f"expert tensor {name!r} must be int32 (packed AWQ), got {t.dtype}")
        for name, t in tensors.items():
            if name in want:
                write_kernel_layout(views[name][0], name, t.to(self.spec(name).dtype), self.intermediate_size,
                                    self.group_size)

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self.views(region.view(1, -1))
        return {name: from_kernel_layout(name, views[name][0], self.intermediate_size) for name in self.names}

    def captured_forward(self, pool, x, topk_ids, topk_weights, slot_of_expert, expert_mask, out, backend,
                         alloc):  # noqa: D102 (see ExpertFormat.captured_forward)
        from moeflow.kernels.experts import ops
        from moeflow.kernels.experts.capturable import nibble_shifts, static_expert_forward

        if backend == "triton":  # the fused kernels' plan and GEMMs over alloc's buffers
            ops.check_triton_device(x)
            w13, w2, group = self.kernel_weights(pool)
            E = slot_of_expert.shape[0]
            cfg = ops.resolve_moe_config(x, E, topk_ids.shape[1], w13[1], group, self.intermediate_size)

            def compute() -> None:
                plan = ops.plan_eager(topk_ids, E, cfg["BLOCK_M"], alloc)
                ops.experts_eager(x, plan, topk_weights, w13, w2, slot_of_expert, expert_mask, group, cfg, out, alloc)
            return compute
        shifts = alloc("nibble_shifts", (8,), torch.int32, x.device)
        shifts.copy_(nibble_shifts(x.device))

        def compute_torch() -> None:
            static_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, expert_mask, out, shifts)
        return compute_torch

    def forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend, *,
                config=None, validate=None):  # noqa: D102 (see ExpertFormat.forward)
        from moeflow.kernels.dispatch import plain_expert_forward

        return plain_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend,
                                    config=config, validate=validate)
