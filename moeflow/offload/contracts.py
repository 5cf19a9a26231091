"""What the offloading backend (:class:`moeflow.offload.backend.OffloadedExperts`) asks of its collaborators, as
Protocols: the copy queue (:class:`~moeflow.offload.copy_engine.LoadQueue`, declared beside the
:class:`~moeflow.offload.copy_engine.CopyEngine`; also the disk tier's
:class:`~moeflow.offload.disk_tier.StagedCopyEngine` and the simulator's engine), the load side
(:class:`SlotLoads`: :class:`~moeflow.offload.slot_loads.SlotLoader`) and the captured prelude
(:class:`PreludeStage`: :class:`~moeflow.offload.prelude.PreludeCapture`). Each implementation is a class with its
own state, built by the backend with an explicit constructor; none reads attributes off the backend."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from moeflow.moe.backend import KernelRouting
from moeflow.offload.cache import ExpertCache, Slot
from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.prelude import Prelude
from moeflow.offload.stats import PhaseStats


class SlotLoads(Protocol):
    """The backend's load side: slots and high-priority loads for a layer's misses, low-priority loads for
    predictions, the synchronous transport's pump and the wait that makes a load visible to compute."""

    cache: ExpertCache

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> None: ...

    def load_deferred(self, layer: int, deferred: deque[int], waiting: list[LoadTask], st: PhaseStats) -> None: ...

    def prefetch_guesses(self, target: int, experts: list[int], layer: int, st: PhaseStats) -> None: ...

    def late_prefetch(self, layer: int, deferred: deque[int], st: PhaseStats) -> bool: ...

    def reclaim_prefetch_slot(self, layer: int, key: tuple[int, int]) -> Slot | None: ...

    def pump(self, st: PhaseStats) -> None: ...

    def wait(self, task: LoadTask, st: PhaseStats) -> None: ...


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
