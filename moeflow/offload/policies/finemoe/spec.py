"""``finemoe`` (FineMoE §4): Expert Map Store search (semantic search from the token embeddings for the first
d layers, trajectory search after), δ-threshold prefetch queued at priority p / (l − l_now), eviction by
1 / (p · freq) (``PriorityEviction(LFU(), p · freq)``), a whole prefill one iteration of the map. Needs no file: the
store fills as it serves."""

from __future__ import annotations

import torch

from moeflow.errors import SchedulingError
from moeflow.offload.eviction import LFU, EvictionPolicy, PriorityEviction
from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.finemoe.runtime import FineMoERuntime
from moeflow.offload.policies.spec import Mechanisms, PolicyContext, PolicySpec


def _finemoe_predictor(ctx: PolicyContext) -> FineMoERuntime:
    pred = load_policy_predictor(ctx, "finemoe")
    if torch.device(ctx.device).type == "cuda":
        pred.start_async()  # searches on a worker thread, off the critical path (FineMoE §4.3)
    return FineMoERuntime(pred, ctx.mechanisms.prefill_iteration)


def _finemoe_eviction(ctx: PolicyContext) -> EvictionPolicy:
    if ctx.predictor is None:
        raise SchedulingError("the finemoe eviction policy ranks by its predictor's maps, but none was built")
    return PriorityEviction(LFU(), ctx.predictor.eviction_score, ctx.predictor.eviction_table)


FINEMOE = PolicySpec(
    "finemoe", "FineMoE: expert-map search (semantic, then trajectory), delta-threshold prefetch by p/(l - l_now), "
               "eviction by 1/(p*freq)",
    eviction=_finemoe_eviction, predictor=_finemoe_predictor,
    # the paper's: a prefill is one iteration of the expert map, p / (l - l_now) orders the copy queue (docs/papers.md)
    mechanisms=Mechanisms(queue_priority=True, prefill_iteration="pass"),
)
