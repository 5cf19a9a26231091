"""The MoE block: router -> top-k -> expert compute (through an :class:`ExpertBackend`) -> combine.

The router and top-k are pure tensor functions (torch.compile traces them); the backend gets the router
logits and may compute a plain softmax top-k inside its own kernels (``forward_logits``). Where the expert weights
live is the backend's business; the engine hands the block its backend on every call, so a block never
holds one. A family with shared experts (Qwen2-MoE, DeepSeek) passes them as ``shared_expert``: an
ordinary resident module whose output is added to the routed experts'.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.moe.backend import ExpertBackend, KernelRouting
from moeflow.moe.routing import RouterSpec, make_router


class RoutingRecorder:
    """Keeps, for the forward pass that just ran, each MoE layer's top-k ids [B, T, k] (int32; -1 for tokens
    that are not real, which are routed to no expert).

    Owned by the engine (micro-batch grouping reads the path each sequence's last token took) and passed
    into the forward pass explicitly; blocks record into it only when they are given one.
    """

    def __init__(self, num_moe_layers: int) -> None:
        self.topk_ids: list[torch.Tensor | None] = [None] * num_moe_layers

    def record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        self.topk_ids[moe_layer] = topk_ids

    def last_token_experts(self) -> list[torch.Tensor]:
        """Per MoE layer, the experts of each sequence's last token: int64 [B, k] on the CPU."""
        missing = [i for i, ids in enumerate(self.topk_ids) if ids is None]
        if missing:
            raise RuntimeError(f"no routing recorded for MoE layers {missing}")
        return [ids[:, -1].long().cpu() for ids in self.topk_ids]


class MoEBlock(nn.Module):
    """A sparse MoE block. ``gate``: the router (an ordinary module, [T, H] -> logits [T, E]).

    ``layer_idx`` is the block's index among the MoE layers (0..num_moe_layers-1), the index the
    backend knows it by, which differs from the decoder layer index once dense layers sit in between.
    """

    def __init__(
        self, hidden_size: int, num_experts: int, router: RouterSpec, layer_idx: int, dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=router.router_bias, dtype=dtype)
        self.router = router
        self.route = make_router(router)
        if router.selection_bias:
            # DeepSeek-V3's ``gate.e_score_correction_bias`` [E] (fp32): chooses experts, never weighs them
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
            biased = self.route
            self.route = lambda logits: biased(logits, self.gate.e_score_correction_bias)
        self.top_k = router.top_k
        # the routers the Triton plan kernel computes itself (grouped, biased, scaled ones stay in torch)
        plain = (router.scoring == "softmax" and not router.topk_before_scoring and not router.selection_bias
                 and router.n_groups == 1 and router.scaling_factor == 1.0)
        self.kernel_routing = KernelRouting(router.top_k, router.renormalize) if plain else None
        self.layer_idx = layer_idx
        self.shared_expert = shared_expert

    def forward(
        self, x: torch.Tensor, experts: ExpertBackend, routing: RoutingRecorder | None = None,
    ) -> torch.Tensor:
        """x [..., H] -> [..., H]; ``routing``: where to keep this layer's top-k ids (when the engine asks)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out, ids = experts.forward_logits(self.layer_idx, flat, self.gate(flat), self.route, self.kernel_routing,
                                          want_ids=routing is not None)
        if routing is not None:
            routing.record(self.layer_idx, ids.reshape(*shape[:-1], self.top_k))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(shape)
