"""One layer's plan: which of its needed experts are ready, under way, missing, or computed on the CPU.

:func:`plan_layer` is pure: it reads the layer's routing (the needed experts, from the layer's one
device->host transfer) and the cache's state (``lookup``) and changes nothing. The backend then acts on the
plan (pins the hits, promotes the loads under way, gives the misses slots).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moeflow.offload.cache import Slot, SlotState
from moeflow.offload.copy_engine import LoadTask


@dataclass
class LayerPlan:
    """ready: resident experts (computed first, in one call). waiting: loads under way, in arrival order.
    deferred: misses still without a slot (the ring hands them slots as groups finish). on_cpu: misses the
    hybrid executor computes instead of copying."""

    layer: int
    ready: list[int] = field(default_factory=list)
    waiting: list[LoadTask] = field(default_factory=list)
    deferred: deque[int] = field(default_factory=deque)
    on_cpu: list[int] = field(default_factory=list)

    def hits(self) -> int:
        return len(self.ready) + len(self.waiting)

    def move_to_cpu(self, experts: list[int]) -> None:
        """The hybrid executor computes ``experts`` (misses) on the CPU: they need no slot."""
        for e in experts:
            self.deferred.remove(e)
            self.on_cpu.append(e)


def plan_layer(layer: int, needed: list[int], lookup: Callable[[tuple[int, int]], Slot | None]) -> LayerPlan:
    """Classify ``needed`` experts of ``layer`` by the cache's state (``lookup((layer, e))``)."""
    plan = LayerPlan(layer)
    for e in needed:
        slot = lookup((layer, e))
        if slot is None:
            plan.deferred.append(e)
        elif slot.state is SlotState.READY:
            plan.ready.append(e)
        else:
            plan.waiting.append(slot.task)
    return plan


def arrival_order(waiting: list[LoadTask]) -> list[LoadTask]:
    """Loads already in the transport first, then the high queue's order."""
    if len(waiting) < 2:
        return list(waiting)
    return sorted(waiting, key=lambda t: (not t.issued, t.order))
