"""Expert predictors: which experts later layers will need, from what earlier layers did.

=============  ===========================================================================  ===========
kind           mechanism                                                                    inputs
=============  ===========================================================================  ===========
popularity     each layer's most frequently chosen experts (the baseline)                   --
skip-gate      layer l+d's router applied to layer l's MoE input (Mixtral-offloading)       hidden
duoserve       DuoServe-MoE ExpertMLP on [activation path, popularity, affinity]            routing
promoe         ProMoE per-layer MLP from layer l's MoE input to layer l+d's experts         hidden
finemoe        FineMoE Expert Map Store: semantic / trajectory search, delta threshold      routing, embed
expertflow     ExpertFlow routing-path predictor: transformer encoder over token ids        token ids
=============  ===========================================================================  ===========

The papers' predictors live in their policy's folder (``moeflow/offload/policies/<paper>/predictor.py``); this
package holds what they share and the table of kinds. All share
:class:`~moeflow.offload.predictors.base.ExpertPredictor` (``observe`` / ``predict`` / ``predicted_mask`` /
``propose``), are built from a :class:`~moeflow.trace.Trace` with :func:`train_predictor` and saved to one file
that :func:`load_predictor` reads back, refusing a model of another shape.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moeflow.offload.policies.duoserve.predictor import DuoServePredictor
from moeflow.offload.policies.expertflow.predictor import ExpertFlowPredictor
from moeflow.offload.policies.finemoe.predictor import ExpertMapStore, FineMoEPredictor
from moeflow.offload.policies.mixtral_offloading.predictor import SkipGatePredictor
from moeflow.offload.policies.promoe.predictor import ProMoEPredictor
from moeflow.offload.predictors.base import (
    ExpertPredictor,
    ModelShape,
    PredictorError,
    PredictorMismatchError,
    TrainInfo,
    read_predictor_blob,
)
from moeflow.offload.predictors.evaluate import EvalResult, check_compatible, evaluate
from moeflow.offload.predictors.popularity import PopularityPredictor
from moeflow.trace import Trace, split_sequence_ids

PREDICTORS: dict[str, type[ExpertPredictor]] = {
    "popularity": PopularityPredictor,
    "skip-gate": SkipGatePredictor,
    "duoserve": DuoServePredictor,
    "promoe": ProMoEPredictor,
    "finemoe": FineMoEPredictor,
    "expertflow": ExpertFlowPredictor,
}
# the papers' prediction distances: DuoServe predicts the next layer, ProMoE strides one further,
# FineMoE prefetches 3 layers ahead on Mixtral-8x7B
PAPER_DISTANCE = {"popularity": 1, "skip-gate": 1, "duoserve": 1, "promoe": 2, "finemoe": 3,
                  "expertflow": 1}  # expertflow predicts every layer before the pass; 1 is nominal


def default_distance(kind: str, num_layers: int) -> int:
    """The paper's distance, shortened so that at least one layer is predicted."""
    return max(1, min(PAPER_DISTANCE[kind], num_layers - 1))


def predictor_class(kind: str) -> type[ExpertPredictor]:
    try:
        return PREDICTORS[kind]
    except KeyError:
        raise PredictorError(f"unknown predictor kind {kind!r} (known: {', '.join(PREDICTORS)})") from None


def load_predictor(path: str | Path, expect: ModelShape | None = None) -> ExpertPredictor:
    """Read a predictor file; ``expect``: the serving model's shape (a mismatch raises
    :class:`PredictorMismatchError` naming the fields that disagree)."""
    blob = read_predictor_blob(path)
    cls = predictor_class(str(blob["kind"]))
    try:
        predictor = cls._from_blob(blob)
    except (TypeError, KeyError) as e:
        raise PredictorError(f"{path}: malformed {blob['kind']} predictor file: {e}") from e
    if expect is not None:
        predictor.shape.check(expect, f"predictor file {path}")
    return predictor


def train_predictor(kind: str, trace: Trace, eval_fraction: float = 0.1, seed: int = 0, distance: int | None = None,
                    **options: Any) -> ExpertPredictor:
    """Split ``trace`` by sequence (``eval_fraction`` held out; ProMoE's 9:1 by default), build the
    predictor from the training sequences and record the split in ``predictor.train_info``.

    options: passed to the predictor's ``fit`` (epochs, widths, capacity, model for skip-gate, ...).
    """
    cls = predictor_class(kind)
    if len(trace) == 0:
        raise PredictorError(f"{trace.source}: the trace holds no tokens")
    if distance is None:
        distance = default_distance(kind, trace.num_layers)
    train_ids, eval_ids = split_sequence_ids(trace.sequence_ids(), eval_fraction, seed)
    train = trace.select(train_ids)
    if kind in ("duoserve", "promoe", "expertflow"):
        options.setdefault("seed", seed)
    predictor = cls.fit(train, distance=distance, **options)
    predictor.train_info = dataclasses.replace(
        predictor.train_info, trace_fingerprint=trace.fingerprint(), trace_model=trace.model,
        train_seq_ids=train_ids, eval_seq_ids=eval_ids, eval_fraction=eval_fraction, seed=seed,
    )
    return predictor


def held_out_rows(predictor: ExpertPredictor, trace: Trace) -> Trace:
    """The rows of ``trace`` the predictor was not built from: its held-out sequences when ``trace`` is
    the training trace, else every row (a trace recorded separately)."""
    info = predictor.train_info
    if info.trace_fingerprint and info.trace_fingerprint == trace.fingerprint():
        if not info.eval_seq_ids:
            raise PredictorError(f"{trace.source} is the trace this predictor was trained on, and no sequence of it "
                                 "was held out (eval_fraction=0): evaluate on another trace")
        return trace.select(info.eval_seq_ids)
    return trace


def evaluate_held_out(predictor: ExpertPredictor, trace: Trace, phase: str = "all") -> dict[str, Any]:
    """Figures of ``predictor`` and of the popularity baseline (the predictor's own training-split
    popularity) on the held-out rows of ``trace``."""
    check_compatible(predictor, trace, "the predictor file")
    rows = held_out_rows(predictor, trace)
    baseline = PopularityPredictor(predictor.shape, predictor.distance, predictor.popularity)
    result = evaluate(predictor, rows, phase).as_dict()
    base = evaluate(baseline, rows, phase).as_dict()
    return {
        "kind": predictor.kind, "distance": predictor.distance, "phase": phase,
        "held_out_sequences": len(rows.sequence_ids()),
        **result,
        "popularity": {k: base[k] for k in ("exact_topk", "at_least_one", "recall", "precision", "mean_predicted")},
    }


__all__ = [
    "PREDICTORS", "PAPER_DISTANCE", "ExpertPredictor", "ModelShape", "PredictorError", "PredictorMismatchError",
    "TrainInfo", "PopularityPredictor", "SkipGatePredictor", "DuoServePredictor", "ProMoEPredictor",
    "FineMoEPredictor", "ExpertFlowPredictor", "ExpertMapStore", "EvalResult", "evaluate", "evaluate_held_out",
    "held_out_rows",
    "load_predictor", "train_predictor", "default_distance", "predictor_class",
]
