"""The baseline policies: every expert resident, accelerate's on-demand loading, LRU / LFU / static caches,
mixtral-offloading (per-layer LRU + next-router speculation) and Fiddler (a static placement, the rest on the
CPU)."""

from __future__ import annotations

from moeflow.offload.eviction import EvictionPolicy, Static
from moeflow.offload.policies.spec import PolicyContext, PolicySpec, evict
from moeflow.offload.predictors.gate_speculator import GateSpeculator


def _gate_speculator(ctx: PolicyContext) -> GateSpeculator:
    return GateSpeculator(ctx.gates, ctx.top_k, ctx.config.prefetch_distance, route=ctx.route)


def _fiddler_eviction(ctx: PolicyContext) -> EvictionPolicy:
    return Static(ctx.n_slots)  # no streaming ring: experts outside the placement run on the CPU


RESIDENT = PolicySpec("resident", "every expert on the device", offload=False)
ONDEMAND = PolicySpec(
    "ondemand", "load each needed expert after its gate and drop it after use (accelerate offload)",
    retain=False, warm_start=False,
)
LRU = PolicySpec("lru", "expert cache, load on miss, evict least recently used", eviction=evict("lru"))
LFU = PolicySpec("lfu", "expert cache, load on miss, evict least frequently used", eviction=evict("lfu"))
STATIC = PolicySpec(
    "static", "most popular experts (first prefill, or a profile) fixed; the rest stream through a ring",
    eviction=evict("static"),
)
MIXTRAL_OFFLOADING = PolicySpec(
    "mixtral-offloading", "per-layer LRU cache plus next-layer speculation: layer l+1's router on layer l's input",
    eviction=evict("lru"), predictor=_gate_speculator, per_layer=True,
)
FIDDLER = PolicySpec(
    "fiddler", "most popular experts placed on the device (profile or first prefill), every other expert computed "
               "on the CPU with int4 kernels (Fiddler)",
    eviction=_fiddler_eviction, cpu_compute="always",
)

BASELINES = (RESIDENT, ONDEMAND, LRU, LFU, STATIC, MIXTRAL_OFFLOADING, FIDDLER)
