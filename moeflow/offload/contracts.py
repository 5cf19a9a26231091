"""What the offloading backend (:class:`moeflow.offload.backend.OffloadedExperts`) asks of its collaborators, as
Protocols: the copy queue (:class:`LoadQueue`: :class:`~moeflow.offload.copy_engine.CopyEngine`, the disk tier's
:class:`~moeflow.offload.disk_tier.StagedCopyEngine`, the simulator's engine), the load side
(:class:`SlotLoads`: :class:`~moeflow.offload.slot_loads.SlotLoader`) and the captured prelude
(:class:`PreludeStage`: :class:`~moeflow.offload.prelude.PreludeCapture`). Each implementation is a class with its
own state, built by the backend with an explicit constructor; none reads attributes off the backend."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from moeflow.moe.backend import KernelRouting
from moeflow.offload.cache import ExpertCache, Slot
from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.prelude import Prelude
from moeflow.offload.stats import PhaseStats
from moeflow.offload.transport import Handle


class LoadQueue(Protocol):
    """The two-priority queue of chunked expert loads (see :mod:`moeflow.offload.copy_engine`). ``threaded``: a
    worker thread issues the copies (else :meth:`pump` does, on the caller's thread)."""

    threaded: bool

    def submit(self, layer: int, expert: int, slot: int, *, high: bool, after: Sequence[Handle] = (),
               stats: PhaseStats | None = None, priority: float = 0.0) -> LoadTask: ...

    def set_low_chunks(self, chunks: Sequence[tuple[int, int]]) -> None: ...

    def promote(self, task: LoadTask) -> None: ...

    def cancel(self, task: LoadTask) -> list[Handle]: ...

    def preempt(self, layer: int, needed: set[int]) -> tuple[list[LoadTask], list[LoadTask]]: ...

    def pending(self) -> list[LoadTask]: ...

    def high_backlog(self) -> list[tuple[LoadTask, int]]: ...

    def wait_issued(self, task: LoadTask) -> None: ...

    def pump(self, max_chunks: int | None = None) -> int: ...

    def close(self) -> None: ...


class SlotLoads(Protocol):
    """The backend's load side: slots and high-priority loads for a layer's misses, low-priority loads for
    predictions, the synchronous transport's pump and the wait that makes a load visible to compute."""

    cache: ExpertCache

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> list[int]: ...

    def load_deferred(self, layer: int, deferred: deque[int], waiting: list[LoadTask], st: PhaseStats) -> None: ...

    def prefetch_guesses(self, target: int, experts: list[int], layer: int, st: PhaseStats) -> list[int]: ...

    def layer_gate(self, layer: int, needed: list[int]) -> None: ...

    def late_prefetch(self, layer: int, deferred: deque[int], st: PhaseStats) -> bool: ...

    def reclaim_prefetch_slot(self, layer: int, key: tuple[int, int]) -> Slot | None: ...

    def pump(self, st: PhaseStats) -> None: ...

    def wait(self, task: LoadTask, st: PhaseStats) -> None: ...

    def warm_fill(self, count: int, num_layers: int) -> None: ...

    def release_unread(self, task: LoadTask) -> None: ...

    def synchronize(self) -> None: ...


class PreludeStage(Protocol):
    """The layer's device prelude in the CUDA-graph decode step's captured piece (:mod:`moeflow.offload.prelude`).
    ``enabled``: False never captures (the eager call at replay; tests compare both)."""

    enabled: bool

    def routes_on_triton(self, x: torch.Tensor, kernel_routing: KernelRouting | None) -> bool: ...

    def refusal(self, x: torch.Tensor, kernel_routing: KernelRouting | None) -> str | None: ...

    def capture(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
                kernel_routing: KernelRouting | None) -> Prelude | None: ...

    def hand_over(self, prelude: object, layer: int) -> Prelude | None: ...

    def take(self) -> Prelude | None: ...
