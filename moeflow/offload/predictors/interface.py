"""The one interface the offloading backend speaks to a predictor: :class:`Predictor`.

Per forward pass the backend calls ``begin_step`` once (before layer 0, with the engine's
:class:`~moeflow.moe.backend.StepInfo`), then per MoE layer ``observe`` (the layer's routing) and ``propose``
(expert ids for later layers, fetched to the host together with the routing in one transfer). Proposed ids are
device tensors (they ride in the layer's one read-back; entries < 0 are padding, so a predictor never needs a
data-dependent shape) or host lists (a plan already on the host: nothing to read back). Every method but
``propose`` has a no-op default, so a predictor implements only what it uses:

* ``bind(runtime)``: the backend's loads (:class:`PrefetchTarget`), for predictors that prefetch outside
  ``forward`` (FineMoE before layer 0, ExpertFlow's whole-budget plan) through ``runtime.prefetch`` /
  ``runtime.cache``;
* ``collect_proposals(layer)``: proposals made beside the layer's expert compute (DuoServe's prediction
  stream), asked for after the layer's first expert group when ``proposes_late`` is True;
* ``observe_host(layer, probs, topk_ids)``: with ``host_routing`` True, the layer's routing as host tensors,
  fetched in the layer's one read-back (FineMoE's map search runs on the host);
* ``predict_paths(step, last_only)``: routing paths bool [B, L, E] for micro-batch grouping (ExpertFlow);
* ``queue_priority(target, expert, layer_now)``: the copy-queue priority of a predicted load (FineMoE §4.5);
* ``close()``: release hooks, threads, side streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch

from moeflow.moe.backend import RoutingPathPlanner, StepInfo
from moeflow.offload.cache import ExpertCache

# [(target layer, expert ids: int tensor [n] on the device (entries < 0: padding) or a host list, most wanted first)]
Proposals = list[tuple[int, "torch.Tensor | list[int]"]]


class PrefetchTarget(Protocol):
    """What :meth:`Predictor.bind` hands a predictor that prefetches outside ``forward``: the backend's slot cache
    and its low-priority loads (:class:`moeflow.offload.slot_loads.SlotLoader`)."""

    cache: ExpertCache

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> list[int]:
        """Queue low-priority loads of layer ``target``'s ``experts`` (best effort: never evicts a load); returns
        the experts queued."""
        ...


class Predictor(ABC):
    """What to prefetch (see the module docstring for the call order)."""

    proposes_late: ClassVar[bool] = False  # the backend calls collect_proposals after a layer's first group
    host_routing: ClassVar[bool] = False  # the backend reads probs/topk_ids back with the layer's one read
    needs_history: ClassVar[bool] = False  # begin_step reads StepInfo.history_ids (every token so far)
    # propose is device work of static shapes that reads no host value and observe does nothing: both may run in
    # a captured CUDA-graph piece (the offload backend's prelude, moeflow/offload/prelude.py)
    captured_proposals: ClassVar[bool] = False

    def as_path_planner(self) -> RoutingPathPlanner | None:
        """This predictor as a routing-path planner (ExpertFlow's PLEC answers itself), or None. Default: None."""
        return None

    def bind(self, runtime: PrefetchTarget) -> None:  # noqa: B027 (optional hook)
        """Where this predictor's prefetches outside ``forward`` go (``prefetch(target, experts, layer_now)``,
        ``cache``)."""

    def begin_step(self, step: StepInfo) -> None:  # noqa: B027 (optional hook)
        """A forward pass starts (called before layer 0)."""

    def observe(  # noqa: B027 (optional hook)
        self, layer: int, x: torch.Tensor | None, probs: torch.Tensor | None, topk_ids: torch.Tensor | None
    ) -> None:
        """Layer ``layer``'s routing: x [T, H] MoE input, probs fp32 [T, E], topk_ids int [T, k]."""

    def observe_host(  # noqa: B027 (optional hook)
        self, layer: int, probs: torch.Tensor, topk_ids: torch.Tensor
    ) -> None:
        """With ``host_routing``: layer ``layer``'s routing on the host, probs fp32 [T, E], topk_ids int64 [T, k]."""

    @abstractmethod
    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        """At layer ``layer`` with MoE input ``x`` [T, H]: [(target_layer, expert ids int [n]), ...]."""

    def collect_proposals(self, layer: int) -> Proposals:
        """Proposals made beside layer ``layer``'s expert compute (only asked when ``proposes_late``), as host
        lists: only those whose copy to the host has completed (polled, never waited for)."""
        return []

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor | None:
        """Predicted routing paths bool [B, L, E] of ``step``'s sequences (None: no path prediction)."""
        return None

    def token_groups(self) -> list[list[int]] | None:
        """The pass's token micro-batches for its MoE layers (ExpertFlow's token scheduler in prefill,
        ``Mechanisms.prefill_regroup``): index lists into the pass's real tokens in the order an MoE layer sees them
        (row by row), together covering each token once; None: one group of every token. Default: None."""
        return None

    def queue_priority(self, target: int, expert: int, layer_now: int) -> float:
        """Copy-queue priority of a predicted load of (``target``, ``expert``) queued at layer ``layer_now``, larger
        first (used with ``Mechanisms.queue_priority``). Default: FineMoE's p / (l - l_now) with p = 1, the nearer
        layer's guesses first; FineMoE's runtime gives its searched p."""
        return 1.0 / max(target - layer_now, 1)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the predictor holds (threads, streams)."""


class LearnedPredictorRuntime(Predictor):
    """A runtime predictor around a learned predictor (``self.predictor``, an ExpertPredictor): its kind,
    distance and lifetime are the learned one's (DuoServe's prediction stream, FineMoE's map search)."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor

    @property
    def kind(self) -> str:
        return self.predictor.kind

    @property
    def distance(self) -> int:
        return self.predictor.distance

    def close(self) -> None:
        self.predictor.close()
