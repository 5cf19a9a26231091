"""The backends that keep every expert in one place: a device slot pool, or host RAM in torch's CPU int4 format."""

from __future__ import annotations

import torch

from moeflow import kernels
from moeflow.compile_boundary import host_logic
from moeflow.kernels.cpu.int4 import COMPUTE_DTYPE, Int4Expert
from moeflow.kernels.cpu.step import experts_step
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.moe.backend import ExpertBackend, KernelRouting


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

    def _route_and_forward(self, layer, x, router_logits, route, kernel_routing: KernelRouting | None, want_ids):
        """On the Triton path a plain softmax top-k is computed by the plan launch itself: with the two expert
        GEMMs and the combine, 4 launches per layer at decode (``kernels.moe_forward(router_logits=...)``)."""
        if kernel_routing is None or not kernels.uses_triton(self.kernels_backend, x.device):
            return super()._route_and_forward(layer, x, router_logits, route, kernel_routing, want_ids)
        result = kernels.moe_forward(
            x, None, None, self.pool, self.slot_tables[layer], "triton", validate=False if x.is_cuda else None,
            router_logits=router_logits, top_k=kernel_routing.top_k, renormalize=kernel_routing.renormalize,
            return_routing=want_ids,
        )
        return (result[0], result[1]) if want_ids else (result, None)


class CpuInt4Experts(ExpertBackend):
    """Every expert in host RAM in torch's CPU int4 format, computed with its int4 kernels (bf16 activations).

    The CPU inference path for AWQ checkpoints: far faster than dequantizing per call (see
    :mod:`moeflow.kernels.cpu.int4` for the numerics and the memory it costs).
    """

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int) -> None:
        if not fmt.cpu_int4:
            raise ValueError(f"CpuInt4Experts needs plain AWQ experts, got expert format {fmt!r}")
        self.fmt = fmt
        self._make = Int4Expert.from_awq_tensors
        self.experts: list[list] = [[None] * num_experts for _ in range(num_layers)]
        self.form_mapping: object | None = None  # the mapped cache file the forms are views of (cpu_form_cache)

    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        self.experts[layer][expert] = self._make(tensors, self.fmt.group_size)

    @host_logic  # host logic (reads the routing back): under torch.compile, the layer's one graph break
    def forward(self, layer, x, probs, topk_ids, topk_weights):  # noqa: D102 (see ExpertBackend)
        return self._forward(layer, x, probs, topk_ids, topk_weights)

    def _forward(self, layer, x, probs, topk_ids, topk_weights):
        # one host read of the routing per layer; each expert runs once on all its tokens
        ids = topk_ids.tolist()
        experts = self.experts[layer]
        weights = topk_weights.float()
        if experts[ids[0][0]].native:  # moeflow's kernels: fp32 activations, one call per expert
            if len(ids) == 1 and x.dtype == torch.float32 and x.is_contiguous() and weights.is_contiguous():
                # decode: the k experts accumulate into one row in k order, as combine sums them (the same
                # numbers as several tokens get)
                return experts_step(x, [(experts[e].w13, experts[e].w2) for e in ids[0]], weights)
            return self._grouped(x, ids, weights, lambda e, rows, w: experts[e].forward(rows, w))
        rows = x.to(COMPUTE_DTYPE)  # torch's kernels: the activations go to bf16 once for all the layer's experts
        if len(ids) == 1:
            acc = None
            for j, e in enumerate(ids[0]):
                y = experts[e].forward_bf16(rows, weights[:, j], x.dtype).float()
                acc = y if acc is None else acc + y
            return acc.to(x.dtype)
        return self._grouped(rows, ids, weights, lambda e, r, w: experts[e].forward_bf16(r, w, x.dtype), x.dtype)

    @staticmethod
    def _grouped(rows: torch.Tensor, ids: list[list[int]], weights: torch.Tensor, run, dtype=None) -> torch.Tensor:
        """Several tokens: each expert on its (token, slot) pairs, then the k outputs of a token summed in k order
        (so a token's result does not depend on the batch). rows [T, H]; weights fp32 [T, k]."""
        k = len(ids[0])
        pairs_of: dict[int, list[int]] = {}  # expert -> its (token, slot) pairs, flattened as token * k + slot
        for t, row in enumerate(ids):
            for j, e in enumerate(row):
                pairs_of.setdefault(e, []).append(t * k + j)
        flat_w = weights.reshape(-1)
        out = torch.empty((len(ids) * k, rows.shape[-1]), dtype=dtype or rows.dtype, device=rows.device)
        for e, pairs in pairs_of.items():
            p = torch.tensor(pairs, device=rows.device)
            out.index_copy_(0, p, run(e, rows[p // k], flat_w[p]))
        return kernels.combine(out, k)
