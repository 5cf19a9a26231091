"""The device side of one offloaded MoE layer: expert groups computed from the slot pool into ``out``, then
the combine. :class:`LayerCompute` is what :class:`moeflow.offload.backend.OffloadedExperts` calls once its
host part has placed a group's slots and fences: eagerly (the kernels' launchers called directly), or inside
:meth:`moeflow.offload.device_step.DeviceGraphs.region` from static buffers and captured graphs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeflow import kernels
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.offload.combine import combine_in_order
from moeflow.offload.cpu_slots import SlotInt4Forms
from moeflow.offload.device_step import Bucket, DeviceGraphs
from moeflow.offload.readback import SlotTables


class LayerCompute:
    """Expert compute and combine of the offload backend (one per backend; every layer shares the pool).

    ``executor`` (the simulator's): accounts a group's compute instead of running it. kernels_backend
    "cpu-int4": the slots also hold torch's CPU int4 form, computed with its kernels.
    """

    def __init__(self, fmt: ExpertFormat, pool: ExpertPool, num_experts: int, top_k: int, kernels_backend: str,
                 executor: Callable | None = None) -> None:
        self.fmt, self.pool, self.num_experts, self.top_k = fmt, pool, num_experts, top_k
        self.device = pool.device
        self.kernels_backend = kernels_backend
        self.executor = executor
        self.slot_tables = SlotTables(self.device, num_experts)
        self.int4_slots = SlotInt4Forms(pool) if kernels.uses_cpu_int4(kernels_backend) else None
        # resolved once: the torch combine is called directly (no custom-op dispatch in eager mode)
        self.combine_backend = kernels.resolve_backend("torch" if self.int4_slots else kernels_backend, self.device)
        self.graphs: DeviceGraphs | None = None
        self.bucket: Bucket | None = None  # the current layer's static buffers (captured device part)

    def begin_layer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids int [T, k], topk_weights fp32 [T, k] -> the layer's ``out [T*k, H]`` to fill."""
        graphs = self.graphs
        self.bucket = graphs.begin_layer(x, topk_ids, topk_weights) if graphs is not None else None
        if self.bucket is not None:
            return self.bucket.out
        return torch.empty((topk_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)

    def compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor, experts: list[int], slots: list[int]) -> None:
        """Fill ``out`` rows of ``experts`` (held in ``slots``); the caller has recorded their loads' fences."""
        if self.executor is not None:
            self.executor(layer, topk_ids, experts)
        elif self.bucket is not None:  # after the fences, on the compute stream (device_step.py)
            self.graphs.compute(self.bucket, experts, slots)
        elif self.int4_slots is not None:
            self.int4_slots.compute(layer, x, topk_ids, topk_weights, out, experts, slots)
        else:
            slot_of_expert, expert_mask = self.slot_tables.fill(experts, slots)
            # value checks cost a device sync per call: keep them on the CPU (tests), skip on the GPU hot path
            kernels.expert_forward(x, topk_ids, topk_weights, self.pool, slot_of_expert, out, expert_mask,
                                   self.kernels_backend, validate=False if self.device.type == "cuda" else None)

    def combine(self, out: torch.Tensor, top_k: int) -> torch.Tensor:
        """out [T*k, H] -> [T, H]; the captured device part's is its static ``y`` (valid until the next layer)."""
        bucket, self.bucket = self.bucket, None
        if bucket is not None:
            return self.graphs.combine(bucket)
        if self.int4_slots is not None:
            return self.int4_slots.combine(out, top_k)
        if not kernels.uses_triton(self.combine_backend, self.device):
            return combine_in_order(out, top_k)
        return kernels.combine(out, top_k, self.combine_backend)  # triton: its eager launcher, no custom op

    def abort(self) -> None:
        """An interrupted layer."""
        self.bucket = None

    def enable_graphs(self, capture_factory: Callable[[torch.device], object]) -> DeviceGraphs:
        """The :class:`DeviceGraphs` of this backend (made once); eager for good where nothing can be captured."""
        if self.graphs is None:
            self.graphs = DeviceGraphs(self.pool, self.num_experts, self.top_k, self.kernels_backend,
                                       capture_factory, disabled=self._uncapturable())
        return self.graphs

    def _uncapturable(self) -> str | None:
        if self.executor is not None:
            return "the simulator's compute executor accounts the compute instead of running it"
        if self.int4_slots is not None:
            return "kernels='cpu-int4' computes the slots with torch's CPU int4 kernels"
        backend = "triton" if kernels.uses_triton(self.kernels_backend, self.device) else "torch"
        return self.fmt.capture_unsupported(backend)  # the format's own answer (ExpertFormat.captured_forward)
