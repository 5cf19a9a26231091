"""ProMoE's learned predictor (§4.2-4.3) with stride prefetching.

One small MLP per target layer maps the MoE-layer input of an earlier layer to the experts the
target layer's router will pick. Its output, like a router's, ranks the experts; the top-k (the
number the model activates per token) are handed to the prefetcher.

* Stride prefetching: the prediction distance is one beyond the next layer (``distance=2``: layer
  l's input predicts layer l+2), so predicting layer l+2 overlaps with prefetching for layer l+1.
* Each per-layer predictor is a two-layer MLP (Linear -> ReLU -> Linear). The paper's size is about
  2 million parameters for a 4096-wide model (a 512-wide hidden layer); smaller models get
  ``min(512, max(64, 2 * hidden))``.
* Training on traces of MoE-layer inputs and router outputs, split 9:1 into train and evaluation
  sets by sequence (the split is done by the caller, :func:`moeflow.offload.predictors.train_predictor`).
  Inputs are standardised per source layer with the training set's mean and std; the loss is BCE on
  the target layer's top-k.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from moeflow.offload.predictors.base import (
    ExpertPredictor,
    ModelShape,
    PredictorError,
    RowViews,
    ids_to_mask,
    popularity_matrix,
)
from moeflow.offload.predictors.eval_mlp import EvalSequential
from moeflow.offload.predictors.train_mlp import train_bce


def promoe_width(hidden_size: int) -> int:
    """512 (about 2M parameters per layer at hidden 4096), scaled down for small models."""
    return min(512, max(64, 2 * hidden_size))


class ProMoEPredictor(ExpertPredictor):
    """Per-layer MLPs from layer ``t - distance``'s MoE input to layer ``t``'s experts."""

    kind = "promoe"
    needs_hidden = True
    needs_routing = False

    def __init__(self, shape: ModelShape, distance: int = 2, popularity: torch.Tensor | None = None,
                 width: int | None = None) -> None:
        super().__init__(shape, distance, popularity)
        if shape.hidden_size is None:
            raise PredictorError("the promoe predictor needs the model's hidden size (a trace recorded with --hidden)")
        H, E, L = shape.hidden_size, shape.num_experts, shape.num_layers
        self.width = width or promoe_width(H)
        # one MLP per target layer t >= distance (index t - distance)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(H, self.width), nn.ReLU(), nn.Linear(self.width, E)) for _ in range(L - distance)
        ).eval()
        self._mlps_eval = [EvalSequential(m) for m in self.mlps]  # the runtime's call: no per-module overhead
        self.mean = torch.zeros(L, H)  # [L, H] per source layer
        self.std = torch.ones(L, H)
        self._stat_rows = RowViews()  # the rows of mean and std

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        h = self._hidden[source_layer].to(self.mean.device)  # [T, H]
        mean, std = self._stat_rows(self.mean, self.std)
        z = (h - mean[source_layer]) / std[source_layer]
        return torch.sigmoid_(self._mlps_eval[target_layer - self.distance](z))  # in place: a fresh tensor

    def _move(self, device: torch.device) -> None:
        self.mlps.to(device)
        for m in self._mlps_eval:
            m.reset()
        self.mean, self.std = self.mean.to(device), self.std.to(device)

    @classmethod
    def fit(cls, trace, distance: int = 2, epochs: int = 20, batch_size: int = 256, lr: float = 1e-3,
            width: int | None = None, seed: int = 0, max_seconds: float | None = None) -> ProMoEPredictor:
        """Train every per-layer MLP on ``trace`` (the training rows; needs ``hidden``)."""
        if trace.hidden is None:
            raise PredictorError(f"{trace.source}: the promoe predictor learns from MoE-layer inputs, but the trace "
                                 "has no 'hidden' tensor (record it with `moeflow trace --hidden`)")
        start = time.perf_counter()
        shape = ModelShape.from_trace(trace)
        self = cls(shape, distance, popularity_matrix(trace.topk_ids, shape.num_experts), width)
        hidden = trace.hidden.float()  # [N, L, H]
        self.mean = hidden.mean(0)
        self.std = hidden.std(0).clamp(min=1e-4) if len(trace) > 1 else torch.ones_like(self.mean)
        notes: dict[str, Any] = {"final_loss": []}
        per_layer = None if max_seconds is None else max_seconds / max(len(self.mlps), 1)
        for i, mlp in enumerate(self.mlps):
            t = i + distance
            s = t - distance
            x = (hidden[:, s] - self.mean[s]) / self.std[s]
            y = ids_to_mask(trace.topk_ids[:, t].long(), shape.num_experts).float()
            losses = train_bce(mlp, x, y, epochs, batch_size, lr, seed + t, per_layer)
            notes["final_loss"].append(losses[-1] if losses else None)
        self.mlps.eval()
        self.train_info.train_tokens = len(trace)
        self.train_info.train_seconds = time.perf_counter() - start
        self.train_info.notes = notes
        return self

    def config(self) -> dict[str, Any]:
        return {"width": self.width}

    def _extra_state(self) -> dict[str, Any]:
        return {"mlps": self.mlps.state_dict(), "mean": self.mean.contiguous(), "std": self.std.contiguous()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        for key in ("mean", "std"):
            t = state.get(key)
            if t is None or tuple(t.shape) != tuple(self.mean.shape):
                raise PredictorError(f"promoe predictor file: {key!r} has shape "
                                     f"{None if t is None else tuple(t.shape)}, expected {tuple(self.mean.shape)}")
        self.mean, self.std = state["mean"].float(), state["std"].float()
        try:
            self.mlps.load_state_dict(state["mlps"])
        except (KeyError, RuntimeError) as e:
            raise PredictorError(f"promoe predictor file: the per-layer MLP weights do not fit: {e}") from e
        self.mlps.eval()
