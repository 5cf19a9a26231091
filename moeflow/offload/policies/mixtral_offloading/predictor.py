"""Mixtral-offloading's speculation: layer l+d's router applied to layer l's MoE input.

The residual stream changes slowly from layer to layer, so the router of a later layer, fed the
current layer's input, approximates that later layer's routing. No training: the predictor holds
the routers' weights (given by the caller: the CLI reads them from a checkpoint, the runtime takes the loaded
model's router modules from the policy context).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from moeflow.offload.predictors.base import ExpertPredictor, ModelShape, PredictorError


class SkipGatePredictor(ExpertPredictor):
    """scores = softmax(W_{l+d} h_l): W_t [E, H] router of the target layer, h_l [T, H] source MoE input."""

    kind = "skip-gate"
    needs_hidden = True
    needs_routing = False

    def __init__(self, shape: ModelShape, distance: int = 1, popularity: torch.Tensor | None = None) -> None:
        super().__init__(shape, distance, popularity)
        if shape.hidden_size is None:
            raise PredictorError("the skip-gate predictor needs the model's hidden size")
        self.gates = torch.zeros(shape.num_layers, shape.num_experts, shape.hidden_size)  # [L, E, H] fp32

    @classmethod
    def from_gates(cls, gates: Sequence[torch.Tensor | torch.nn.Module], top_k: int, distance: int = 1,
                   popularity: torch.Tensor | None = None) -> SkipGatePredictor:
        """gates: per layer, the router weight [E, H] (or the router nn.Linear)."""
        weights = [g.weight if isinstance(g, torch.nn.Module) else g for g in gates]
        if not weights:
            raise PredictorError("from_gates needs at least one router weight")
        E, H = weights[0].shape
        for i, w in enumerate(weights):
            if tuple(w.shape) != (E, H):
                raise PredictorError(f"router weight of layer {i} has shape {tuple(w.shape)}, layer 0 has {(E, H)}")
        self = cls(ModelShape(len(weights), E, top_k, H), distance, popularity)
        self.gates = torch.stack([w.detach().to("cpu", torch.float32) for w in weights])
        return self

    @classmethod
    def fit(cls, trace, distance: int = 1, routers: Sequence[torch.Tensor] | None = None) -> SkipGatePredictor:
        """routers: the model's router weights [E, H], one per MoE layer (the CLI reads them from ``--model``);
        the trace gives the popularity prior of the first ``distance`` layers."""
        if routers is None:
            raise PredictorError("the skip-gate predictor is built from the model's routers: pass the checkpoint "
                                 "(--model PATH)")
        start = time.perf_counter()
        from moeflow.offload.predictors.base import popularity_matrix

        self = cls.from_gates(routers, trace.top_k, distance, popularity_matrix(trace.topk_ids, trace.num_experts))
        self.shape.check(ModelShape.from_trace(trace), "the routers", "the trace")
        self.train_info.train_tokens = len(trace)
        self.train_info.train_seconds = time.perf_counter() - start
        return self

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        h = self._hidden[source_layer]  # [T, H]
        w = self.gates[target_layer].to(h.device)  # [E, H]
        return torch.softmax(h @ w.T, dim=-1)

    def _move(self, device: torch.device) -> None:
        self.gates = self.gates.to(device)

    def _extra_state(self) -> dict[str, Any]:
        return {"gates": self.gates.contiguous()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        gates = state.get("gates")
        want = (self.shape.num_layers, self.shape.num_experts, self.shape.hidden_size)
        if gates is None or tuple(gates.shape) != want:
            raise PredictorError(f"skip-gate predictor file: 'gates' has shape "
                                 f"{None if gates is None else tuple(gates.shape)}, expected {want}")
        self.gates = gates.float()
