"""How ``generate()`` runs its decode steps: a :class:`~moeflow.moe.decode.DecodeStrategy`, the policy's or the
plain loop.

``generate()`` asks :func:`choose_decode` once per call: the policy's strategy (``PolicySpec.decode``: expertflow's
dual-batch pipeline) where the caller's arguments ask for it, else :class:`PlainDecode`. The Protocols
(``DecodeStrategy``, ``DecodeLoop``) live in :mod:`moeflow.moe.decode`, where a policy's strategy can name them
without importing the engine; :class:`GenerateLoop` is the engine's ``DecodeLoop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from moeflow.errors import InputError, SchedulingError
from moeflow.moe.backend import ExpertBackend, StepInfo
from moeflow.moe.block import RoutingRecorder
from moeflow.moe.decode import DecodeLoop, DecodeStrategy, DecodeStrategyFactory, PassRunner, SideLane
from moeflow.offload import OffloadedExperts, registered_policies
from moeflow.offload.policies.expertflow.scheduler import group_by_routing

PathPredictor = Callable[[StepInfo, bool], "torch.Tensor | None"]

__all__ = ["DecodeLoop", "DecodeStrategy", "DecodeStrategyFactory", "GenerateLoop", "MicroBatcher", "PlainDecode",
           "choose_decode", "policy_decode"]


class LoopRunner(PassRunner, Protocol):
    """The engine's runner as the loop uses it (``engine.generate.Runner``)."""

    device: torch.device
    decoder: Any
    decode_fn: Callable[..., torch.Tensor]
    decode_strategy: DecodeStrategyFactory | None


class MicroBatcher:
    """Runs a pass for the whole batch, or micro-batch by micro-batch regrouped by routing paths (ExpertFlow)."""

    def __init__(self, runner: LoopRunner, batch: int, micro_batch_size: int | None,
                 group: Callable[[torch.Tensor, int], list[list[int]]] = group_by_routing):
        """group: the token scheduler, paths bool [B, L, E] and the size -> micro-batches (the decode strategy's)."""
        self.runner, self.batch, self.size, self.group = runner, batch, micro_batch_size, group
        self.paths = torch.zeros((batch, runner.num_moe_layers, runner.num_experts), dtype=torch.bool)
        self.groups = [list(range(batch))]
        self.routing = RoutingRecorder(runner.num_moe_layers) if micro_batch_size is not None else None
        if micro_batch_size is not None:
            self.groups = [list(range(i, min(i + micro_batch_size, batch))) for i in range(0, batch, micro_batch_size)]

    def regroup(self, paths: torch.Tensor) -> None:
        """paths bool [B, L, E] (predicted or observed) -> new micro-batches."""
        self.groups = self.group(paths.cpu(), self.size)

    def run(self, ids, positions, cache, cache_position, token_mask, phase: str, history,
            all_real: bool = False) -> torch.Tensor:
        """Logits of the last position [B, V] for inputs [B, T]; ``history``: (ids, mask) [B, S]; ``all_real``:
        token_mask is all True."""
        if self.size is None:
            return self.runner.forward_pass(ids, positions, cache, cache_position, token_mask, phase,
                                            history=history, last_only=True, all_real=all_real)[:, -1]
        logits = None
        for group in self.groups:
            rows = torch.tensor(group, dtype=torch.long, device=ids.device)
            out = self.runner.forward_pass(
                ids[rows], positions[rows], cache.rows(rows), cache_position, token_mask[rows], phase, rows,
                (history[0][rows], history[1][rows]), self.routing, last_only=True, all_real=all_real)[:, -1]
            if logits is None:
                logits = out.new_empty((self.batch, out.shape[-1]))
            logits[rows] = out
            for layer, last in enumerate(self.routing.last_token_experts()):  # [b, k] per MoE layer
                self.paths[group, layer] = False
                routed = last >= 0  # a finished row's token is not routed (-1)
                self.paths[torch.tensor(group)[:, None].expand_as(last)[routed], layer, last[routed]] = True
        self.regroup(self.paths)
        return logits


def policy_decode(backend: ExpertBackend | None) -> DecodeStrategyFactory | None:
    """The decode strategy the backend's policy declares (``PolicySpec.decode``), or None (the plain loop): for
    an offloading backend, its policy's (the one ``auto`` picked, by name in the registered table)."""
    if not isinstance(backend, OffloadedExperts):
        return None
    spec = registered_policies().get(backend.policy_name)
    return spec.decode if spec is not None else None


class GenerateLoop:
    """The generate loop's :class:`~moeflow.moe.decode.DecodeLoop`: the runner, the cache, every token so far (hist /
    hist_mask [B, S]), the finished rows, the micro-batcher (its groups) and the sampler."""

    def __init__(self, runner: LoopRunner, cache: Any, hist: torch.Tensor, hist_mask: torch.Tensor,
                 finished: torch.Tensor, micro_batch_size: int | None,
                 pick: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], lane: Callable[[], SideLane]) -> None:
        self.runner, self.cache, self.hist, self.hist_mask = runner, cache, hist, hist_mask
        self.finished, self.micro_batch_size = finished, micro_batch_size
        self.batch = hist.shape[0]
        self._pick, self._lane = pick, lane
        self.batcher: MicroBatcher | None = None  # set by generate() once the strategy gave its scheduler

    @property
    def groups(self) -> list[list[int]]:
        return self.batcher.groups if self.batcher is not None else [list(range(self.batch))]

    def pick(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._pick(logits, rows)

    def lane(self) -> SideLane:
        return self._lane()


class PlainDecode:
    """The plain loop: each decode step is one pass over the whole batch, or micro-batch by micro-batch regrouped
    by routing paths before the step (``predict_paths``: the backend's or the caller's; moeflow's variant of the
    token scheduler). Finished rows are masked out of eager passes (their tokens route to no expert)."""

    stats = None

    def __init__(self, loop: GenerateLoop, predict_paths: PathPredictor) -> None:
        self.loop, self.predict_paths = loop, predict_paths
        runner = loop.runner
        # finished rows still run (their tokens are padding, discarded) but are not real: their tokens route to no
        # expert. Eager decode only: a compiled or captured step keeps one token mask (all real).
        self.mask_finished = runner.decode_fn is runner.decoder
        self.ones = torch.ones((loop.batch, 1), dtype=torch.bool, device=runner.device)

    def regroup(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        return group_by_routing(paths.cpu(), micro_batch_size)

    def step(self, tok: torch.Tensor, next_pos: torch.Tensor, n: int, done: torch.Tensor) -> tuple[torch.Tensor, int]:
        loop, b = self.loop, self.loop.batch
        history = (loop.hist[:, :n], loop.hist_mask[:, :n])
        running = ~loop.finished[:, None] if self.mask_finished and bool(done.any()) else self.ones
        pass_tokens = b - int(done.sum()) if running is not self.ones else b
        all_real = running is self.ones
        step_info = StepInfo(tok[:, None], next_pos[:, None], running, "decode", history_ids=history[0],
                             history_mask=history[1], all_real=all_real)
        if loop.micro_batch_size is not None:
            paths = self.predict_paths(step_info, True)
            if paths is not None:
                loop.batcher.regroup(paths)
        logits = loop.batcher.run(tok[:, None], next_pos[:, None], loop.cache,
                                  torch.tensor([n - 1], device=tok.device), running, "decode", history,
                                  all_real=all_real)
        return loop.pick(logits, torch.arange(b, device=tok.device)), pass_tokens

    def close(self) -> None:
        pass


def choose_decode(loop: GenerateLoop, dual_batch: bool | None, predict_paths: PathPredictor,
                  custom_paths: bool) -> DecodeStrategy:
    """The call's decode strategy. ``dual_batch`` None (default): the policy's (``PolicySpec.decode``) when
    micro-batches are asked and no ``path_predictor`` replaces the policy's; False: the plain loop; True: the
    policy's, an InputError without ``micro_batch_size`` and a SchedulingError when the policy declares none."""
    runner = loop.runner
    make = runner.decode_strategy
    if dual_batch is None:
        use = make is not None and loop.micro_batch_size is not None and not custom_paths
    else:
        use = bool(dual_batch)
        if use and loop.micro_batch_size is None:
            raise InputError("generate(dual_batch=True) runs micro-batches: give micro_batch_size as well")
        if use and make is None:
            raise SchedulingError(f"generate(dual_batch=True) runs the policy's decode strategy (expertflow's "
                                  f"dual-batch pipeline, on its routing-path predictor); {runner.backend!r} declares "
                                  "none")
    if not use:
        return PlainDecode(loop, predict_paths)
    return make(loop)
