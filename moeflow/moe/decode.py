"""The seam between the generate loop and a policy's way of decoding: :class:`DecodeStrategy`.

``generate()`` owns the prefill and the loop (sampling the first token, EOS, the stats, the streamer); each decode
step it hands to a strategy. The default is the engine's plain loop (``engine.decode.PlainDecode``: the whole
batch, or micro-batches regrouped before every step); a policy may declare its own in its
:class:`~moeflow.offload.policies.spec.PolicySpec` (``decode``: ExpertFlow's dual-batch pipeline). The engine
offers the strategy a :class:`DecodeLoop`: the runner of forward passes, the KV cache, every token so far and the
sampler. These are Protocols here, on the floor both the engine and the policies stand on, so a policy's strategy
names what it uses without importing the engine (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from moeflow.moe.backend import ExpertBackend


class PassRunner(Protocol):
    """What runs one forward pass (``engine.generate.Runner``)."""

    backend: ExpertBackend
    num_moe_layers: int
    num_experts: int

    def forward_pass(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, cache_position: torch.Tensor,
        token_mask: torch.Tensor, phase: str, rows: torch.Tensor | None = None,
        history: tuple[torch.Tensor, torch.Tensor] | None = None, routing: Any = None,
        path_scores: torch.Tensor | None = None, last_only: bool = False, all_real: bool = False,
        return_hidden: bool = False,
    ) -> Any:
        """ids/positions/token_mask [b, T] of the batch rows ``rows`` -> logits fp32 [b, T, V]."""
        ...


class RowCache(Protocol):
    """A KV cache whose rows a micro-batch attends to in place (``StaticKVCache.rows``)."""

    def rows(self, rows: torch.Tensor) -> Any:
        """The view of ``rows`` [b] (int64 row indices)."""
        ...


class SideLane(Protocol):
    """Where a strategy's side work runs (``engine.side_lane``: a worker thread, inline, or a virtual clock)."""

    overlaps: bool
    busy_s: float
    exposed_s: float

    def clock(self) -> float: ...

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future: ...

    def wait(self, future: Future) -> Any: ...

    def close(self) -> None: ...


class DecodeLoop(Protocol):
    """What the generate loop offers a decode strategy.

    batch: B.  micro_batch_size: the caller's (None: the whole batch).  hist / hist_mask [B, S]: every token so far,
    cache-aligned (column j = cache position j).  finished bool [B]: rows past EOS (their tokens are padding).
    """

    runner: PassRunner
    cache: RowCache
    batch: int
    micro_batch_size: int | None
    hist: torch.Tensor
    hist_mask: torch.Tensor
    finished: torch.Tensor

    @property
    def groups(self) -> list[list[int]]:
        """The micro-batches the prefill ran (the first decode step's)."""
        ...

    def pick(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [b, V] of ``rows`` [b] -> their next tokens [b] (padding for finished rows)."""
        ...

    def lane(self) -> SideLane:
        """The lane for side work (made on the first call: the caller's, else a worker thread)."""
        ...


class DecodeStrategy(Protocol):
    """How the decode steps of one ``generate`` run.

    ``regroup`` forms micro-batches from routing paths (the prefill's too, so it is asked before the first step);
    ``step`` advances every row one token; ``close`` ends the call (a failed side job re-raises there). ``stats``:
    the strategy's counters of the call (``MoEModel.pipeline_stats``), None when it keeps none.
    """

    stats: Any

    def regroup(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        """paths bool [B, L, E] (predicted or observed) -> micro-batches: sorted row lists of at most
        ``micro_batch_size``."""
        ...

    def step(self, tok: torch.Tensor, next_pos: torch.Tensor, n: int, done: torch.Tensor) -> tuple[torch.Tensor, int]:
        """tok [B] (hist column n - 1), next_pos [B] its positions, done bool [B] on the host (finished rows) ->
        (the next tokens [B], sampled with ``DecodeLoop.pick``; the real tokens the step's passes computed)."""
        ...

    def close(self) -> None: ...


DecodeStrategyFactory = Callable[[DecodeLoop], DecodeStrategy]
"""A policy's decode strategy, made for one ``generate`` call (``PolicySpec.decode``)."""
