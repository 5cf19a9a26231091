"""FineMoE in the runtime: :class:`FineMoERuntime` announces each forward pass to the Expert Map Store (its
semantic search), drives the trajectory search layer by layer and gives the copy-queue and eviction priorities."""

from __future__ import annotations

import numpy as np
import torch

from moeflow.moe.backend import StepInfo
from moeflow.offload.policies.finemoe.predictor import ExpertMapStore, FineMoEPredictor, prefetch_priority
from moeflow.offload.predictors.interface import LearnedPredictorRuntime, PrefetchTarget, Proposals


class FineMoERuntime(LearnedPredictorRuntime):
    """FineMoE in the runtime: each forward pass is announced by ``begin_step`` with its token embeddings.

    ``begin_step`` publishes the previous iteration's map (``end_iteration``), starts the new one with the
    embeddings (``begin_iteration``: the semantic search) and prefetches the first ``d`` layers' δ-selected
    experts through the bound backend's ``prefetch``; during the pass ``observe`` / ``propose`` drive the
    trajectory search for layer ``l + d``.
    """

    host_routing = True  # the map search runs on the host: probs and top-k come with the layer's one read-back

    def __init__(self, predictor: FineMoEPredictor, prefill_iteration: str = "token") -> None:
        """prefill_iteration: "pass" makes a whole prefill one iteration of the expert map (the paper's), "token"
        one iteration per prompt token (``Mechanisms.prefill_iteration``)."""
        super().__init__(predictor)
        predictor.runtime_mode = True
        self.prefill_pass = prefill_iteration == "pass"
        self._runtime: PrefetchTarget | None = None
        self._views: tuple | None = None  # eviction_table's numpy views of the predictor's guidance and counts

    @property
    def store(self) -> ExpertMapStore:
        return self.predictor.store

    def bind(self, runtime: PrefetchTarget) -> None:
        self._runtime = runtime

    def begin_step(self, step: StepInfo) -> None:
        if step.embeds is None:  # a plan-only step (micro-batch grouping): nothing runs
            return
        pred = self.predictor
        pred.end_iteration()
        pred.aggregate = self.prefill_pass and step.phase == "prefill"  # one map (mean rows) for the whole prefill
        embeds, real = step.embeds.detach().reshape(-1, step.embeds.shape[-1]), step.real_tokens
        pred.begin_iteration(embeds if real is None else embeds.index_select(0, real))  # padding searches nothing
        if self._runtime is None:
            return
        for target in range(min(pred.distance, pred.shape.num_layers)):  # the semantic search's guesses
            self._runtime.prefetch(target, pred.selection(target, -1), layer_now=0)

    def observe_host(self, layer: int, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """The layer's routing, read back with its one read: extends the trajectory, starts its search."""
        self.predictor.observe(layer, None, probs, topk_ids)

    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        """Host lists from the previous layer's search (never waits for this layer's)."""
        return self.predictor.runtime_proposals(layer)

    def queue_priority(self, target: int, expert: int, layer_now: int) -> float:
        """FineMoE §4.5: p / (l - l_now), p the expert's probability in the map last searched for ``target``."""
        return float(prefetch_priority(float(self.predictor.guidance[target, expert]), target,
                                       min(layer_now, target - 1)))

    def eviction_score(self, key: tuple[int, int], layer_now: int = 0) -> float:
        return self.predictor.eviction_score(key, layer_now)

    def eviction_table(self, layer_now: int = 0) -> np.ndarray:
        """Every key's ``eviction_score`` at once, float32 [L, E] (the vectorised victim choice)."""
        pred = self.predictor
        views = self._views
        if views is None or views[0] is not pred.guidance or views[1] is not pred.freq:  # numpy views, made once
            views = self._views = (pred.guidance, pred.freq, pred.guidance.numpy(), pred.freq.numpy(),
                                   np.empty(tuple(pred.freq.shape), dtype=np.float32))
        return np.multiply(views[2], views[3], out=views[4])
