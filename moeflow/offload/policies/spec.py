"""What a named offload policy is: a :class:`PolicySpec` (the scheduler's parts) over a :class:`PolicyContext`.

Every paper's system is one spec, so every policy runs on the same model, prompts and memory budget. A spec
names each part once: the eviction policy and the predictor are factories of the context (the predictor is
built first, so an eviction policy may rank by it); there is no field that overrides another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from moeflow.offload.eviction import EvictionPolicy, make_eviction

if TYPE_CHECKING:
    from moeflow.config import OffloadConfig
    from moeflow.offload.predictors.interface import Predictor



@dataclass(frozen=True)
class PolicyContext:
    """What a policy's factories may build from."""

    config: OffloadConfig
    num_layers: int
    num_experts: int
    top_k: int
    n_slots: int
    ring_slots: int
    gates: Sequence[nn.Module]  # one router per MoE layer: x [T, H] -> logits [T, E]
    device: Any
    checkpoint_dir: Any = None  # the model's directory (predictor policies look for predictors/<kind>.pt there)
    route: Callable | None = None  # the family's routing (logits -> probs, ids, weights); None: softmax-top-k
    predictor: Any = None  # the policy's predictor, set before ``eviction`` is called (FineMoE's eviction uses it)


def evict(name: str) -> Callable[[PolicyContext], EvictionPolicy]:
    """The factory of a named eviction policy ("lru", "lfu", "static": see :mod:`moeflow.offload.eviction`)."""
    def make(ctx: PolicyContext) -> EvictionPolicy:
        return make_eviction(name, n_slots=ctx.n_slots, ring_slots=ctx.ring_slots)
    make.__name__ = f"evict_{name}"
    return make


@dataclass(frozen=True)
class PolicySpec:
    """One named policy.

    offload: False keeps every expert resident (``ResidentExperts``); the other fields then do not apply.
    eviction / predictor: factories of the context (predictor None: no prefetching).
    retain: keep experts in their slots after use (False: accelerate-style on-demand).
    warm_start: fill the empty pool at load time instead of starting cold.
    per_layer: partition the pool, ``n_slots // num_layers`` slots per layer (when that is >= 1).
    prefill_ring: in prefill at most top-k of a layer's loads hold slots at once (DuoServe's k-slot ring).
    cpu_compute: the policy's own hybrid mode (used when ``OffloadConfig.cpu_compute`` is None); a policy
        that sets it cannot run with ``cpu_compute="never"``.
    select: for "auto" only: the name of the policy to run, chosen from the context.
    """

    name: str
    description: str = ""
    offload: bool = True
    eviction: Callable[[PolicyContext], EvictionPolicy] = evict("lru")
    predictor: Callable[[PolicyContext], Predictor] | None = None
    retain: bool = True
    warm_start: bool = True
    per_layer: bool = False
    prefill_ring: bool = False
    cpu_compute: str | None = None
    select: Callable[[PolicyContext], str] | None = None
