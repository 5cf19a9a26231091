"""Glue for the offload policies: predictor and eviction-score factories taking a ``PolicyContext``.

``moeflow.offload.policies.register_policy(PolicySpec(name, predictor=..., eviction=...))``
hands its factories a context with ``num_layers``, ``num_experts``, ``top_k``, ``gates`` (the routers),
``device`` and ``config``. The helpers here build predictors from it:

    from moeflow.offload.predictors.runtime import predictor_factory, finemoe_eviction_score
    predictor = predictor_factory("duoserve", path="duoserve.pt")      # a trained file
    predictor = predictor_factory("skip-gate")                              # the model's own routers
    predictor = predictor_factory("finemoe")                                # empty store, fills as it serves
    PriorityEviction(LFU(), finemoe_eviction_score(predictor))              # FineMoE's 1 / (p * freq)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeflow.offload.predictors import (
    PREDICTORS,
    ExpertPredictor,
    FineMoEPredictor,
    ModelShape,
    PredictorError,
    SkipGatePredictor,
    default_distance,
    load_predictor,
)


def context_shape(ctx: Any) -> ModelShape:
    """The serving model's shape from a PolicyContext (hidden size from the first router)."""
    hidden = None
    gates = getattr(ctx, "gates", None)
    if gates:
        hidden = int(gates[0].weight.shape[1])
    return ModelShape(ctx.num_layers, ctx.num_experts, ctx.top_k, hidden)


def build_predictor(kind: str, ctx: Any, path: str | Path | None = None, distance: int | None = None,
                    **options: Any) -> ExpertPredictor:
    """A ready predictor for the model of ``ctx``: loaded from ``path`` (checked against the model's shape),
    or, without a file, skip-gate from the routers and FineMoE with an empty store."""
    if kind not in PREDICTORS:
        raise PredictorError(f"unknown predictor kind {kind!r} (known: {', '.join(PREDICTORS)})")
    shape = context_shape(ctx)
    if path is not None:
        pred = load_predictor(path, expect=shape)
        if pred.kind != kind:
            raise PredictorError(f"predictor file {path} holds a {pred.kind!r} predictor, not {kind!r}")
        if distance is not None and distance != pred.distance:
            raise PredictorError(f"predictor file {path} was trained for distance {pred.distance}, not {distance}")
    elif kind == "skip-gate":
        pred = SkipGatePredictor.from_gates(list(ctx.gates), ctx.top_k, distance or 1)
    elif kind == "finemoe":
        pred = FineMoEPredictor(shape, distance or default_distance("finemoe", shape.num_layers), **options)
    else:
        raise PredictorError(f"the {kind} predictor is learned from a trace: give its file "
                             "(`moeflow train-predictor --kind {kind}`)")
    return pred.to(getattr(ctx, "device", "cpu"))


def predictor_factory(kind: str, path: str | Path | None = None, distance: int | None = None,
                      **options: Any) -> Callable[[Any], ExpertPredictor]:
    """A ``predictor`` factory for :class:`moeflow.offload.policies.PolicySpec`."""
    def make(ctx: Any) -> ExpertPredictor:
        return build_predictor(kind, ctx, path, distance, **options)
    return make


def finemoe_eviction_score(predictor: FineMoEPredictor) -> Callable[[tuple[int, int], int], float]:
    """``score(key, layer_now)`` for ``PriorityEviction`` (lowest evicted first): p * freq, i.e. FineMoE's
    eviction priority 1 / (p * freq) highest first."""
    return predictor.eviction_score
