"""An offloaded layer's device prelude, captured in the CUDA-graph decode step's piece before the layer.

Between the router's logits and the host's schedule, :class:`moeflow.offload.backend.OffloadedExperts` runs device
work of static shapes that needs no host value: on the Triton path the routing (one launch of the resident backend's
route kernel), a predictor's proposals where they are device work of static shapes
(``Predictor.captured_proposals``: mixtral-offloading's next-layer router) and the read-back's staging (the
needed-expert mask and the proposals, their asynchronous copy into pinned memory). Run eagerly per layer per step it is
host time (~80 us of launcher Python for the routing on the lent H100's host, ~5 torch ops for the staging). With
the decode step captured (:mod:`moeflow.engine.cuda_graphs`) it is enqueued at the end of the piece that computes
the logits (``OffloadedExperts.capture_prelude``, through :meth:`PreludeCapture.capture`), so the piece's replay
runs it; the backend's call for the layer (``OffloadedExperts.forward_prelude``) then records the read-back's
event, waits, schedules and runs the device part from the prelude's static routing (handed over with
:meth:`PreludeCapture.hand_over`), exactly as the eager path does from its own (same kernel, same
arguments: bitwise the same ids and weights; the same mask read back).

Where the prelude is not captured (:meth:`PreludeCapture.refusal`), the call at replay is the eager
``forward_logits``, as before: a router the kernels cannot compute (``kernel_routing`` None), the torch kernels (and
the CPU's ``cpu-int4``), a predictor other than those (it observes the routing probabilities or the hidden state,
proposes on the host or on DuoServe's side stream, or reads the routing back with the read-back's own read: finemoe,
expertflow, promoe, duoserve, ...), hybrid CPU compute (its workers take the routing on the host). At replay it also
falls back when the pass's tokens are not all real (the prelude routed every row of the captured shape) or the
prelude is another backend's. The read-back's captured staging has buffers of its own, never grown
(:meth:`moeflow.offload.readback.ReadBack.capture_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow import kernels
from moeflow.moe.backend import KernelRouting
from moeflow.offload.predictors.interface import Predictor
from moeflow.offload.readback import ReadBack


@dataclass
class Prelude:
    """One layer's captured prelude: its static routing, rewritten by every replay of the piece that holds it."""

    owner: object  # the PreludeCapture that captured it
    layer: int
    topk_ids: torch.Tensor  # int32 [T, k]
    topk_weights: torch.Tensor  # fp32 [T, k]
    proposals: list  # the predictor's [(target layer, device ids int [n])]


class PreludeCapture:
    """The offloading backend's prelude stage (see the module docstring).

    kernels_backend: the backend's expert kernels ("triton", "auto", ...); predictor: the policy's, whose
    proposals the prelude makes when they are device work of static shapes; readback: the backend's read-back,
    whose staging the prelude captures; hybrid: misses may run on the CPU (its workers take the routing on the
    host: never captured); enabled: False never captures (the eager call at replay; tests compare both).
    """

    def __init__(self, kernels_backend: str, predictor: Predictor | None, readback: ReadBack, *, hybrid: bool,
                 enabled: bool = True) -> None:
        self.kernels_backend = kernels_backend
        self.predictor = predictor
        self.readback = readback
        self.hybrid = hybrid
        self.enabled = enabled
        self._handed: Prelude | None = None  # the prelude the backend's next layer reads back instead of posting

    def routes_on_triton(self, x: torch.Tensor, kernel_routing: KernelRouting | None) -> bool:
        """Whether the layer is routed by the Triton route kernel (a plain softmax top-k on the Triton path)."""
        return kernel_routing is not None and kernels.uses_triton(self.kernels_backend, x.device)

    def refusal(self, x: torch.Tensor, kernel_routing: KernelRouting | None) -> str | None:
        """Why the layer's prelude is not captured, or None."""
        if not self.enabled:
            return "switched off (PreludeCapture.enabled)"
        if not self.routes_on_triton(x, kernel_routing):
            return "the layer is not routed by the Triton route kernel"
        pred = self.predictor
        if pred is not None and not (pred.captured_proposals and not pred.host_routing and not pred.proposes_late):
            return "the predictor observes the routing or proposes on the host"
        if self.hybrid:
            return "hybrid CPU compute takes the routing on the host"
        return None

    def capture(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
                kernel_routing: KernelRouting | None) -> Prelude | None:
        """x [T, H], router_logits [T, E]: enqueue the routing and the read-back's staging (in the piece being
        captured; eagerly at the warm-up, which makes the staging's buffers); None where refused."""
        if self.refusal(x, kernel_routing) is not None:
            return None
        ids, weights = kernels.route(router_logits, kernel_routing.top_k, "triton",
                                     renormalize=kernel_routing.renormalize)
        proposals = self.predictor.propose(layer, x) if self.predictor is not None else []
        self.readback.capture_stage(ids, [p for _, p in proposals])
        return Prelude(self, layer, ids, weights, proposals)

    def hand_over(self, prelude: object, layer: int) -> Prelude | None:
        """At replay: ``prelude`` if it is this stage's for ``layer`` (not another backend's), which the backend's
        next layer then takes (:meth:`take`) instead of posting a read; else None (the eager path)."""
        if not isinstance(prelude, Prelude) or prelude.owner is not self or prelude.layer != layer:
            return None
        self._handed = prelude
        return prelude

    def take(self) -> Prelude | None:
        """The prelude handed over for the layer being computed (once), or None: the eager path."""
        prelude, self._handed = self._handed, None
        return prelude
