"""Named policies: presets of the scheduler's parts (eviction, retention, prediction).

Each paper's system is one preset, so every policy runs on the same model, prompts and memory budget.
The predictors issue adds "duoserve", "promoe", "expertflow", "finemoe" here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from moeflow.config import POLICIES, OffloadConfig
from moeflow.errors import SchedulingError


@dataclass(frozen=True)
class PolicyContext:
    """What a policy's factories may build from (handed to ``make_predictor`` / ``make_eviction``)."""

    config: OffloadConfig
    num_layers: int
    num_experts: int
    top_k: int
    n_slots: int
    ring_slots: int
    gates: Sequence[nn.Module]
    device: Any
    checkpoint_dir: Any = None  # the model's directory (predictor policies look for predictors/<kind>.pt there)
    embed_tokens: nn.Module | None = None  # the embedding layer (FineMoE hooks it for the semantic search)
    predictor: Any = None  # the policy's predictor, set before make_eviction is called (FineMoE's eviction uses it)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    offload: bool = True  # False: every expert resident (ResidentExperts)
    eviction: str = "lru"  # see moeflow.scheduling.eviction
    retain: bool = True  # keep experts in their slots after use (False: accelerate-style on-demand)
    speculate: bool = False  # prefetch with the next layers' routers on the current hidden state
    warm_start: bool = True  # fill the empty pool at load time instead of starting cold
    per_layer: bool = False  # partition the pool: n_slots // num_layers per layer (when that is >= 1)
    description: str = ""
    # extension points for the predictor policies (they override ``speculate`` / ``eviction``)
    make_predictor: Callable[[PolicyContext], Any] | None = None  # -> moeflow.scheduling.predictor.Predictor
    make_eviction: Callable[[PolicyContext], Any] | None = None  # -> moeflow.scheduling.eviction.EvictionPolicy
    # hybrid execution: the policy's own cpu_compute mode (used when OffloadConfig.cpu_compute is None);
    # a policy that sets it cannot run with cpu_compute="never"
    cpu_compute: str | None = None
    # "auto": the name of the preset to run, chosen from the context (slot budget, predictor files)
    select: Callable[[PolicyContext], str] | None = None
    # extra OffloadedExperts keywords from the context (e.g. DuoServe's k-slot prefill ring)
    backend_options: Callable[[PolicyContext], dict] | None = None


def _fiddler_eviction(ctx: PolicyContext) -> Any:
    from moeflow.scheduling.eviction import Static

    return Static(ctx.n_slots)  # no streaming ring: experts outside the placement run on the CPU


PRESETS: dict[str, PolicySpec] = {
    "resident": PolicySpec("resident", offload=False, description="every expert on the device"),
    "ondemand": PolicySpec(
        "ondemand", retain=False, warm_start=False,
        description="load each needed expert after its gate and drop it after use (accelerate offload)",
    ),
    "lru": PolicySpec("lru", eviction="lru", description="expert cache, load on miss, evict least recently used"),
    "lfu": PolicySpec("lfu", eviction="lfu", description="expert cache, load on miss, evict least frequently used"),
    "static": PolicySpec(
        "static", eviction="static",
        description="most popular experts (first prefill, or a profile) fixed; the rest stream through a ring",
    ),
    "mixtral-offloading": PolicySpec(
        "mixtral-offloading", eviction="lru", speculate=True, per_layer=True,
        description="per-layer LRU cache plus next-layer speculation: layer l+1's router on layer l's input",
    ),
    "fiddler": PolicySpec(
        "fiddler", eviction="static", make_eviction=_fiddler_eviction, cpu_compute="always",
        description="most popular experts placed on the device (profile or first prefill), every other expert "
                    "computed on the CPU with int4 kernels (Fiddler)",
    ),
}


def register_policy(spec: PolicySpec, *, replace: bool = False) -> None:
    """Add a named preset (the predictors module registers "duoserve", "promoe", ... this way)."""
    if spec.name in PRESETS and not replace:
        raise ValueError(f"offload policy {spec.name!r} is already registered")
    PRESETS[spec.name] = spec


def get_policy(name: str) -> PolicySpec:
    """The preset called ``name``; SchedulingError listing the known ones otherwise."""
    if name not in PRESETS:
        ordered = [p for p in POLICIES if p in PRESETS] + sorted(p for p in PRESETS if p not in POLICIES)
        known = ", ".join(repr(p) for p in ordered)
        raise SchedulingError(f"unknown offload policy {name!r}; known policies: {known}")
    return PRESETS[name]
