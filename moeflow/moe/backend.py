"""The seam between the model and the place its experts live: :class:`ExpertBackend` and :class:`StepInfo`.

The engine owns the step loop and tells the backend what a forward pass is about before layer 0
(``begin_step``); each MoE block then hands one layer to ``forward``. Nothing else crosses this
seam: no module hooks, no attributes read off the model, no flags set on blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

import torch

from moeflow.kernels.formats import ExpertFormat
from moeflow.moe.routing import Router


class KernelRouting(NamedTuple):
    """A router the expert kernels can compute in their own plan launch: softmax over the E logits (fp32),
    top-k (ties: lowest expert), optionally renormalised, weights unscaled (Mixtral, Qwen-MoE, OLMoE)."""

    top_k: int
    renormalize: bool


@dataclass(frozen=True)
class StepInfo:
    """What one forward pass (a prefill, a decode step, or one micro-batch of either) is about.

    input_ids [B, T] int64: this pass's tokens.  positions [B, T] int64: their position ids.
    token_mask bool [B, T]: real tokens (False on left padding).  rows [B] int64 or None: the cache rows
    of a micro-batch (None: the whole batch, rows 0..B-1).  embeds [B, T, H] or None: the embedding
    output (None when the caller asks only for a plan, e.g. micro-batch grouping).  phase: "prefill" or
    "decode".  history_ids [B, S] int64 / history_mask bool [B, S] or None: every token of each sequence so
    far, prompt and generated (path predictors read them).  path_scores [B, L, E] fp32 or None: routing-path
    scores of each row's last token predicted ahead of the pass (the dual-batch pipeline computes them beside
    the previous micro-batch's pass; a path predictor uses them instead of predicting again).  all_real: the
    engine knows on the host that every token is real (a decode step of running rows): no read of token_mask.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_mask: torch.Tensor
    phase: str
    rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    history_ids: torch.Tensor | None = None
    history_mask: torch.Tensor | None = None
    path_scores: torch.Tensor | None = None
    all_real: bool = False

    @cached_property
    def real_tokens(self) -> torch.Tensor | None:
        """The real tokens' indices int64 [N] into the pass's B*T tokens flattened row by row (the order an MoE
        block sees them), on token_mask's device; None when every token is real. One host read of token_mask
        (unless ``all_real``), made once per pass."""
        if self.all_real:
            return None
        flat = self.token_mask.reshape(-1).cpu()
        if bool(flat.all()):
            return None
        return flat.nonzero().flatten().to(self.token_mask.device)


class PathPlanState(Protocol):
    """The plan's side a routing-path planner shares with the dual-batch pipeline: ``upcoming`` (set by the pipeline
    for one pass: the next pass's plan when known, polled without blocking) and the counters it reads."""

    upcoming: Callable[[], dict[int, list[int]] | None] | None
    next_pass_prefetches: int
    planned_at_start: int
    resident_at_start: int


class RoutingPathPlanner(Protocol):
    """A predictor of each pass's routing paths from the tokens so far (ExpertFlow's PLEC), as the dual-batch
    decode pipeline (``offload/policies/expertflow/pipeline.py``) drives it: scores computed beside the previous
    pass, then grouped and planned. ``state`` holds the policy's counters across calls."""

    state: PathPlanState

    def step_scores(self, step: StepInfo) -> torch.Tensor:
        """Scores fp32 [B, L, E] of each row's last token from its tokens so far (reads, changes no state)."""
        ...

    def paths_from_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [B, L, E] -> bool paths [B, L, E] (each row's top-k per layer)."""
        ...

    def plan_from_scores(self, scores: torch.Tensor) -> dict[int, list[int]]:
        """Scores [N, L, E] of a pass's tokens -> per layer the experts to have ready."""
        ...

    def group(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        """paths bool [B, L, E] -> micro-batches by the policy's token scheduler (``Mechanisms.keep_contiguous``)."""
        ...


class DevicePart(Protocol):
    """A backend's device part captured per batch size (:meth:`ExpertBackend.enable_device_graphs`): inside
    ``region()`` the backend's ``forward`` replays it instead of launching its kernels one by one."""

    def region(self) -> AbstractContextManager[None]: ...


class ExpertBackend(ABC):
    """Where expert weights live and how a layer's experts get computed.

    Lifecycle: ``load_expert`` for every (layer, expert), then ``finish_loading`` once; per forward
    pass ``begin_step`` once, then ``forward`` per MoE layer in layer order; ``close`` at the end.
    """

    fmt: ExpertFormat
    # the body of a ``torch.compiler.disable``d ``forward`` (host logic), called directly in eager mode
    # (:meth:`_forward_to_call`); a backend that keeps one defines the method, None: ``forward`` is called
    _forward: Callable[..., torch.Tensor] | None = None

    @abstractmethod
    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store one expert's tensors (names of ``fmt``) at load time. Called from several loader threads at once
        for distinct experts (:mod:`moeflow.engine.parallel_load`): an implementation must be safe for that."""

    def finish_loading(self) -> None:  # noqa: B027 (optional hook)
        """Called once after every expert was loaded (checks, warm start). Default: nothing to do."""

    _real_tokens: tuple[torch.Tensor | None, int] | None = None  # this pass's (StepInfo.real_tokens, B*T)

    def begin_step(self, step: StepInfo) -> None:
        """Called by the engine before layer 0 of every forward pass. The base keeps the pass's real tokens, which
        :meth:`forward_logits` computes alone; an override calls it."""
        self._real_tokens = (step.real_tokens, step.token_mask.numel())

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor | None:
        """Predicted routing paths bool [B, L, E] for micro-batch grouping, or None (no path predictor)."""
        return None

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> list[int]:
        """Queue copies of MoE layer ``target``'s ``experts`` (most wanted first) ahead of the pass that needs them,
        best effort, e.g. MTP speculation's verify pass predicted from its drafts (:mod:`moeflow.engine.mtp_prefetch`);
        returns the experts whose copy was queued. Default: every expert is in place already, nothing to queue."""
        return []

    @property
    def path_planner(self) -> RoutingPathPlanner | None:
        """The policy's routing-path planner (what expertflow's dual-batch pipeline drives), or None. Default: None."""
        return None

    @property
    def needs_history(self) -> bool:
        """Whether ``begin_step`` reads ``StepInfo.history_ids`` (a path predictor): the serving engine keeps
        each sequence's tokens on the device only then. Default: False."""
        return False

    @abstractmethod
    def forward(
        self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], probs fp32 [T, E], topk_ids int32 [T, k], topk_weights fp32 [T, k] -> [T, H]."""

    def forward_logits(
        self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
        route: Router,
        kernel_routing: KernelRouting | None, want_ids: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer from its router logits: x [T, H], router_logits [T, E] -> (out [T, H], topk_ids int32 [T, k]
        when ``want_ids``, else None). ``route`` is the block's router (logits -> probs, ids, weights);
        ``kernel_routing`` says the kernels may compute the same router themselves (None: they cannot).

        Tokens that are not real (left padding, a finished row, a short chunk's right padding:
        ``StepInfo.real_tokens``) are left out before routing, so they pull in, count and cost nothing anywhere
        behind this seam; their output is 0 (finite: nothing can leak into real tokens through attention) and
        their ids -1. The real tokens go through :meth:`_route_and_forward`.
        """
        real = self._real_tokens
        if real is None or real[0] is None or real[1] != x.shape[0]:  # every token real (or a call outside a pass)
            return self._route_and_forward(layer, x, router_logits, route, kernel_routing, want_ids)
        index = real[0]
        out = x.new_zeros(x.shape)
        if not index.numel():  # no real token at all (a micro-batch of finished rows)
            k = route(router_logits[:1])[1].shape[1] if want_ids else 0
            return out, torch.full((x.shape[0], k), -1, dtype=torch.int32, device=x.device) if want_ids else None
        part, part_ids = self._route_and_forward(layer, x.index_select(0, index), router_logits.index_select(0, index),
                                                 route, kernel_routing, want_ids)
        out.index_copy_(0, index, part)
        if not want_ids:
            return out, None
        ids = torch.full((x.shape[0], part_ids.shape[1]), -1, dtype=torch.int32, device=x.device)
        return out, ids.index_copy_(0, index, part_ids.to(torch.int32))

    def _route_and_forward(
        self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
        route: Router,
        kernel_routing: KernelRouting | None, want_ids: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward_logits` of tokens that are all real. Default: ``route`` then :meth:`forward`. A backend
        whose kernels fuse the routing into their launches overrides it
        (:class:`~moeflow.moe.resident.ResidentExperts` on the Triton path)."""
        probs, ids, weights = route(router_logits)
        return self._forward_to_call()(layer, x, probs, ids, weights), ids if want_ids else None

    def capture_prelude(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
                        kernel_routing: KernelRouting | None) -> object | None:
        """Called by the CUDA-graph decode step (:mod:`moeflow.engine.cuda_graphs`) at the end of the piece that
        computes ``router_logits`` [T, E], while it is captured (and once before, at its warm-up): the backend may
        enqueue here the device work of the layer that needs no host value (its routing, a read-back's staging),
        so the piece's replay runs it, and return what :meth:`forward_prelude` consumes at replay. Default:
        None, nothing captured (the call at replay is :meth:`forward_logits`)."""
        return None

    def forward_prelude(
        self, prelude: object, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
        route: Router,
        kernel_routing: KernelRouting | None,
    ) -> torch.Tensor:
        """The layer's output [T, H] after the replay of a piece that holds ``prelude`` (:meth:`capture_prelude`'s
        result, its static outputs rewritten by that replay). Default: :meth:`forward_logits`."""
        return self.forward_logits(layer, x, router_logits, route, kernel_routing, False)[0]

    def _forward_to_call(self) -> Callable[..., torch.Tensor]:
        """:meth:`forward`; in eager mode its body ``_forward`` where a backend keeps one behind a
        ``torch.compiler.disable``d ``forward`` (host logic: the graph break under torch.compile), which skips
        the wrapper's cost on every call."""
        if torch.compiler.is_compiling() or type(self)._forward is None:
            return self.forward
        return self._forward

    def enable_device_graphs(self, capture_factory: Callable[[torch.device], object]) -> DevicePart | None:
        """Called by the CUDA-graph decode step (:mod:`moeflow.engine.cuda_graphs`) before each replay: the
        backend's device part captured per batch size with ``capture_factory(device)`` (made once), replayed inside
        its ``region()``; None: nothing to capture, ``forward`` runs as ever. Default: None."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release threads, streams and host registrations. Default: nothing to release."""
