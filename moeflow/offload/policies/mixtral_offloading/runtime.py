"""mixtral-offloading's speculation in the runtime: layer ``l + d``'s router applied to layer ``l``'s MoE input.

Consecutive layers' hidden states are close (residual stream), so the next router's top-k on the current
input is a good guess. The routers and the routing function come from the context (``PolicyContext.gates``,
``route``), so any family's routing can be speculated. For a batch of tokens the experts are ranked by summed
probability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module

from moeflow.moe import route as softmax_topk
from moeflow.offload.predictors.interface import Predictor, Proposals

Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class GateSpeculator(Predictor):
    """gates: one router per MoE layer (x [T, H] -> logits [T, E]); route: logits [T, E] -> (probs fp32 [T, E],
    ids int32 [T, k], weights fp32 [T, k]) (default: softmax, top-k, renormalise)."""

    captured_proposals = True  # a router and a top-k on the device, no observation

    def __init__(self, gates: Sequence[nn.Module], top_k: int, distance: int = 1, max_experts: int | None = None,
                 route: Route | None = None):
        self.gates = list(gates)
        self.top_k = top_k
        self.distance = distance
        self.max_experts = max_experts or top_k
        self.route = route or (lambda logits: softmax_topk(logits, top_k))

    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        if torch.is_grad_enabled():  # generate() runs under inference_mode: no context to enter per layer
            with torch.no_grad():
                return self._propose(layer, x)
        return self._propose(layer, x)

    def _propose(self, layer: int, x: torch.Tensor) -> Proposals:
        out = []
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= len(self.gates):
                break
            probs, top, _ = self.route(_logits(self.gates[target], x))
            if probs.shape[0] == 1:
                ids = top[0]  # int32: the read-back takes any integer dtype
            else:
                # several tokens: the union of their top-k, ranked by summed probability
                top = top.long()
                mass = torch.zeros(probs.shape[-1], device=probs.device).index_add_(
                    0, top.reshape(-1), probs.gather(1, top).reshape(-1)
                )
                ids = torch.topk(mass, min(self.max_experts, probs.shape[-1])).indices
            out.append((target, ids))
        return out


def _logits(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gate(x); a plain ``nn.Linear`` without hooks is called as its forward would (``F.linear``), without the
    module call's own Python (~4 us on a small CPU, once per layer)."""
    if type(gate) is nn.Linear and not (gate._forward_hooks or gate._forward_pre_hooks or _module._global_forward_hooks
                                        or _module._global_forward_pre_hooks):
        return torch._C._nn.linear(x, gate.weight, gate.bias)
    return gate(x)
