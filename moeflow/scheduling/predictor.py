"""What to prefetch: the predictor interface and the one predictor the baselines need.

At each layer the backend first calls ``observe`` with the layer's routing, then ``propose``: at layer
``l``'s MoE input the predictor proposes device tensors of expert ids for later layers (most wanted
first). The backend fetches all proposals together with the layer's own routing in one
device->host transfer, so predicting costs no extra synchronisation. The predictors issue adds learned
predictors behind the same two methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn


class Predictor(Protocol):
    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """At layer ``layer`` with MoE input ``x`` [T, H]: [(target_layer, expert ids int [n]), ...]."""

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """The actual routing of ``layer`` (for predictors that learn or keep history)."""


class GateSpeculator:
    """mixtral-offloading's speculation: layer ``l + d``'s router applied to layer ``l``'s hidden state.

    Consecutive layers' hidden states are close (residual stream), so the next router's top-k on the
    current input is a good guess. For a batch of tokens the experts are ranked by summed probability.
    """

    def __init__(self, gates: Sequence[nn.Module], top_k: int, distance: int = 1, max_experts: int | None = None):
        self.gates = list(gates)
        self.top_k = top_k
        self.distance = distance
        self.max_experts = max_experts or top_k

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        out = []
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= len(self.gates):
                break
            with torch.no_grad():
                logits = self.gates[target](x)
                probs = torch.softmax(logits.float(), dim=-1)
                if probs.shape[0] == 1:
                    ids = torch.topk(probs[0], min(self.top_k, probs.shape[-1])).indices
                else:
                    # several tokens: the union of their top-k, ranked by summed probability
                    top = torch.topk(probs, self.top_k, dim=-1).indices
                    mass = torch.zeros(probs.shape[-1], device=probs.device).index_add_(
                        0, top.reshape(-1), probs.gather(1, top).reshape(-1)
                    )
                    ids = torch.topk(mass, min(self.max_experts, probs.shape[-1])).indices
            out.append((target, ids))
        return out

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        return None
