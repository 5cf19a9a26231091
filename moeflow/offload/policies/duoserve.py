"""``duoserve`` (DuoServe-MoE §5).

Prefill streams each layer's missing experts through a ring of k slots (at most k of a layer's loads hold
slots at once; one computes while the next copies), cached experts first. Decode runs the DuoServe ExpertMLP
as a separate prediction step beside the expert compute (a side CUDA stream on a GPU) and prefetches its
guesses for the next layer once the layer's first expert group is computed (the paper's second
synchronisation point); a miss at the gate is re-fetched at high priority (the runtime's acquire). Global LRU.
"""

from __future__ import annotations

import torch

from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.spec import PolicyContext, PolicySpec, evict
from moeflow.offload.predictors.base import ExpertPredictor
from moeflow.offload.predictors.interface import LearnedPredictorRuntime, Proposals


class OverlappedPredictor(LearnedPredictorRuntime):
    """A predictor whose prediction step runs beside the expert compute (DuoServe's prediction stream).

    ``observe`` records the routing and starts predicting the next layer: on CUDA on a side stream that
    first waits for the compute stream, so the ExpertMLP runs while the layer's experts compute; on the
    CPU at once. ``propose`` gives nothing (nothing rides on the routing sync); the backend calls
    :meth:`collect_proposals` after the layer's first expert group is computed, which joins the side
    stream and hands over the guesses.
    """

    proposes_late = True

    def __init__(self, predictor: ExpertPredictor, device: torch.device | str) -> None:
        super().__init__(predictor)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: tuple[int, Proposals] | None = None

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        pred = self.predictor
        pred.observe(layer, x if pred.needs_hidden else None, probs, topk_ids)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                proposals = pred.propose(layer, x)
        else:
            proposals = pred.propose(layer, x)
        self._pending = (layer, proposals)

    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        return []

    def collect_proposals(self, layer: int) -> Proposals:
        if self._pending is None or self._pending[0] != layer:
            return []
        _, proposals = self._pending
        self._pending = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return proposals


def _duoserve_predictor(ctx: PolicyContext) -> OverlappedPredictor:
    return OverlappedPredictor(load_policy_predictor(ctx, "duoserve"), ctx.device)


DUOSERVE = PolicySpec(
    "duoserve", "DuoServe-MoE: prefill streams experts through a k-slot ring; decode prefetches the ExpertMLP's "
                "next-layer guess, predicted beside the expert compute; misses re-fetched at the gate",
    eviction=evict("lru"), predictor=_duoserve_predictor, prefill_ring=True,
)
