"""The MoE block: router -> top-k -> expert compute (through an :class:`ExpertBackend`) -> combine.

The router and top-k are pure tensor functions (torch.compile traces them). Where the expert
weights live is the backend's business: :class:`ResidentExperts` keeps every expert in one device
pool (the compile-friendly path), the offloading backends of :mod:`moeflow.offload` stream them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow import kernels
from moeflow.kernels.pool import ExpertFormat, ExpertPool
from moeflow.moe.backend import ExpertBackend, StepInfo

__all__ = ["route", "ExpertBackend", "StepInfo", "ResidentExperts", "CpuInt4Experts", "MoEBlock"]


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral routing: softmax in fp32, top-k, renormalise.

    router_logits [T, E] -> (probs fp32 [T, E], topk_ids int32 [T, k], topk_weights fp32 [T, k]).
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, ids.to(torch.int32), weights


class ResidentExperts(ExpertBackend):
    """Every expert of every layer in one device pool; slot of (layer, expert) = layer * E + expert."""

    def __init__(
        self, fmt: ExpertFormat, num_layers: int, num_experts: int, device: torch.device | str,
        kernels_backend: str = "torch",
    ) -> None:
        self.fmt = fmt
        self.num_experts = num_experts
        self.kernels_backend = kernels_backend
        self.pool = ExpertPool.allocate(fmt, num_layers * num_experts, device)
        base = torch.arange(num_experts, dtype=torch.int32, device=device)
        self.slot_tables = [base + layer * num_experts for layer in range(num_layers)]

    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        self.fmt.write(self.pool.buffer[layer * self.num_experts + expert], tensors)

    def forward(self, layer, x, probs, topk_ids, topk_weights):  # noqa: D102 (see ExpertBackend)
        # value checks cost one host sync per call: skip them on the GPU hot path (ids come from our own top-k)
        return kernels.moe_forward(
            x, topk_ids, topk_weights, self.pool, self.slot_tables[layer], self.kernels_backend,
            validate=False if x.is_cuda else None,
        )


class CpuInt4Experts(ExpertBackend):
    """Every expert in host RAM in torch's CPU int4 format, computed with its int4 kernels (bf16 activations).

    The CPU inference path for AWQ checkpoints: far faster than dequantizing per call (see
    :mod:`moeflow.kernels.cpu_int4` for the numerics and the memory it costs).
    """

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int) -> None:
        from moeflow.kernels.cpu_int4 import Int4Expert

        if fmt.kind != "awq":
            raise ValueError(f"CpuInt4Experts needs AWQ experts, got expert format {fmt.kind!r}")
        self.fmt = fmt
        self._make = Int4Expert.from_awq_tensors
        self.experts: list[list] = [[None] * num_experts for _ in range(num_layers)]

    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        self.experts[layer][expert] = self._make(tensors, self.fmt.group_size)

    def forward(self, layer, x, probs, topk_ids, topk_weights):  # noqa: D102 (see ExpertBackend)
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        flat_w = topk_weights.reshape(-1).float()
        out = torch.empty((flat_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
        for e in torch.unique(flat_ids).tolist():
            pairs = torch.nonzero(flat_ids == e).squeeze(1)
            out[pairs] = self.experts[layer][e].forward(x[pairs // k], flat_w[pairs])
        return kernels.combine(out, k)


class MoEBlock(nn.Module):
    """Mixtral's sparse MoE block. The router ``gate`` is an ordinary module; experts sit in ``experts``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.top_k = top_k
        self.layer_idx = layer_idx
        self.experts: ExpertBackend | None = None  # set by the loader (not a submodule: owns no parameters)
        self.record_routing = False  # keep the last top-k ids (generate's token scheduler reads them)
        self.last_topk_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, ids, weights = route(self.gate(flat), self.top_k)
        if self.record_routing:
            self.last_topk_ids = ids.reshape(*shape[:-1], self.top_k)
        return self.experts.forward(self.layer_idx, flat, probs, ids, weights).reshape(shape)
