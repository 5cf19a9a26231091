"""The baseline policies: every expert resident, accelerate's on-demand loading, LRU / LFU / static caches and
Fiddler (a static placement, the rest on the CPU: its runtime is the backend's hybrid compute, so it has no
folder of its own). mixtral-offloading, which has a predictor, is in ``mixtral_offloading/``."""

from __future__ import annotations

from moeflow.offload.eviction import EvictionPolicy, Static
from moeflow.offload.policies.spec import PolicyContext, PolicySpec, evict


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
FIDDLER = PolicySpec(
    "fiddler", "most popular experts placed on the device (profile or first prefill), every other expert computed "
               "on the CPU with int4 kernels (Fiddler)",
    eviction=_fiddler_eviction, cpu_compute="always",
)

BASELINES = (RESIDENT, ONDEMAND, LRU, LFU, STATIC, FIDDLER)
