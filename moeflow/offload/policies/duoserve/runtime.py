"""DuoServe-MoE's prediction stream in the runtime: :class:`OverlappedPredictor` runs the ExpertMLP beside the
expert compute and hands its guesses over without a host wait (§5)."""

from __future__ import annotations

import contextlib

import torch

from moeflow.offload.predictors.base import ExpertPredictor
from moeflow.offload.predictors.interface import LearnedPredictorRuntime, Proposals
from moeflow.offload.readback import AsyncHostCopy


class OverlappedPredictor(LearnedPredictorRuntime):
    """A predictor whose prediction step runs beside the expert compute (DuoServe's prediction stream).

    ``observe`` records the routing and starts predicting layer ``l + d``: on CUDA on a side stream that first
    waits for the compute stream (the inputs are ``record_stream``-ed to it), so the ExpertMLP runs while the
    layer's experts compute; its ids are copied to pinned host memory on that stream. Nothing waits for it:
    :meth:`collect_proposals` (the backend asks after each expert group of the layer, DuoServe's second
    synchronisation point) polls the copy's event and hands the ids over once they landed; if they have not
    by the end of the layer, :meth:`propose` of the next layer hands the device ids to that layer's one
    read-back (the compute stream waits for the side stream there: an ordering, not a host wait). On the CPU
    the prediction runs in ``observe`` and its ids (host memory already, no copy) are collected at the first poll.
    """

    proposes_late = True

    def __init__(self, predictor: ExpertPredictor, device: torch.device | str) -> None:
        super().__init__(predictor)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # the model's compute stream, bound now as the transport binds it (a Stream object per layer costs ~18 us)
        self.compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        self._copy = AsyncHostCopy(self.device)  # the ids to pinned host memory (on the CPU: read in place)
        self._pending: tuple[int, int, torch.Tensor] | None = None  # (layer, target, device ids)
        self._carry: tuple[int, int, torch.Tensor] | None = None  # the previous layer's, never collected

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        pred = self.predictor
        pred.observe(layer, x if pred.needs_hidden else None, probs, topk_ids)
        self._carry, self._pending = self._pending, None
        side = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(self.compute)
            for t in (x, probs, topk_ids):  # made on the compute stream, read on the side stream
                t.record_stream(self.stream)
            side = torch.cuda.stream(self.stream)
        with side:
            proposals = pred.propose(layer, x)
            if proposals:
                self._copy.post(proposals[0][1])
        if proposals:
            (target, ids), = proposals
            self._pending = (layer, target, ids)

    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        """The previous layer's prediction, if it was never collected: it rides in this layer's read-back."""
        pending, self._carry = self._carry, None
        if pending is None or pending[0] != layer - 1 or pending[1] <= layer:
            return []  # distance 1: its target is this very layer, whose routing the read-back brings anyway
        if self.stream is not None:
            self.compute.wait_stream(self.stream)
            pending[2].record_stream(self.compute)
        return [(pending[1], pending[2])]

    def collect_proposals(self, layer: int) -> Proposals:
        if self._pending is None or self._pending[0] != layer or not self._copy.ready():
            return []
        _, target, _ = self._pending
        self._pending = None
        return [(target, self._copy.values())]
