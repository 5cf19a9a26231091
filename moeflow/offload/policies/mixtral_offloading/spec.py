"""``mixtral-offloading`` (Eliseev & Mazur): a per-layer LRU cache plus speculation, layer l+d's router applied to
layer l's input (``OffloadConfig.prefetch_distance``)."""

from __future__ import annotations

from moeflow.offload.policies.mixtral_offloading.runtime import GateSpeculator
from moeflow.offload.policies.spec import PolicyContext, PolicySpec, evict


def _gate_speculator(ctx: PolicyContext) -> GateSpeculator:
    return GateSpeculator(ctx.gates, ctx.top_k, ctx.config.prefetch_distance, route=ctx.route)


MIXTRAL_OFFLOADING = PolicySpec(
    "mixtral-offloading", "per-layer LRU cache plus next-layer speculation: layer l+1's router on layer l's input",
    eviction=evict("lru"), predictor=_gate_speculator, per_layer=True,
)
