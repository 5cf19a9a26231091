"""The baseline: each layer's most popular experts (DuoServe eq. 2), whatever the token."""

from __future__ import annotations

import time

import torch

from moeflow.offload.predictors.base import ExpertPredictor, ModelShape, popularity_matrix


class PopularityPredictor(ExpertPredictor):
    """Scores = P_l, the share of layer l's selections each expert got in the training trace."""

    kind = "popularity"
    needs_routing = False

    @classmethod
    def fit(cls, trace, distance: int = 1) -> PopularityPredictor:
        """trace: the training rows (a :class:`~moeflow.trace.Trace`)."""
        start = time.perf_counter()
        self = cls(ModelShape.from_trace(trace), distance, popularity_matrix(trace.topk_ids, trace.num_experts))
        self.train_info.train_tokens = len(trace)
        self.train_info.train_seconds = time.perf_counter() - start
        return self

    def predict(self, target_layer: int) -> torch.Tensor:
        """P_target [1, E], whatever was observed."""
        if not 0 <= target_layer < self.shape.num_layers:
            return super().predict(target_layer)  # the range error
        return self.prior(target_layer)

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        return self.prior(target_layer)
