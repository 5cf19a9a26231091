"""``promoe`` (ProMoE §4-5): the learned per-layer predictor with stride (distance 2 from its file), chunked
low-priority prefetch, early preemption at the gate, reordered inference, per-layer LRU cache (a prediction of a
cached expert refreshes its recency)."""

from __future__ import annotations

from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.spec import Mechanisms, PolicyContext, PolicySpec, evict
from moeflow.offload.predictors.base import ExpertPredictor


def _promoe_predictor(ctx: PolicyContext) -> ExpertPredictor:
    return load_policy_predictor(ctx, "promoe")


PROMOE = PolicySpec(
    "promoe", "ProMoE: learned per-layer predictor with stride, chunked prefetch, early preemption, reordered "
              "inference, per-layer LRU cache",
    eviction=evict("lru"), predictor=_promoe_predictor, per_layer=True,
    # the paper's LRU (a prediction of a cached expert refreshes it): measured better, docs/papers.md; prefetch
    # chunks stay the <= 8 MiB pieces (a needed load waits behind less than one linear layer's copy)
    mechanisms=Mechanisms(refresh_on_prefetch=True),
)
