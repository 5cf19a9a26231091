"""Held-out accuracy of a predictor on a trace, replaying the trace through the predictor interface.

For every token and every target layer ``t >= distance`` the predictor's prefetch set (its
``predicted_mask`` after ``predict(t)``, given layers up to ``t - distance`` of the same forward
pass) is compared with the k experts the router actually chose:

* ``exact_topk``: share of (token, layer) pairs whose k needed experts were all predicted;
* ``at_least_one``: share with at least one needed expert predicted;
* ``recall``: needed experts that were predicted / needed experts;
* ``precision``: predicted experts that were needed / predicted experts;
* ``mean_predicted``: experts predicted per (token, layer) (k for top-k predictors; FineMoE varies).

The first ``distance`` layers, predicted before the forward pass has routed anything (popularity,
or FineMoE's semantic search), are reported separately under ``first_layers``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moeflow.offload.predictors.base import ExpertPredictor, ModelShape, PredictorError
from moeflow.trace import Trace


@dataclass
class Tally:
    """Running sums for the four figures."""

    pairs: int = 0
    exact: int = 0
    at_least_one: int = 0
    hits: int = 0
    needed: int = 0
    predicted: int = 0

    def add(self, pred: torch.Tensor, actual: torch.Tensor) -> None:
        """pred, actual bool [R, E]."""
        hit = (pred & actual).sum(-1)
        need = actual.sum(-1)
        self.pairs += int(actual.shape[0])
        self.exact += int((hit == need).sum())
        self.at_least_one += int((hit > 0).sum())
        self.hits += int(hit.sum())
        self.needed += int(need.sum())
        self.predicted += int(pred.sum())

    def figures(self) -> dict[str, float | int | None]:
        if self.pairs == 0:
            return {"exact_topk": None, "at_least_one": None, "recall": None, "precision": None,
                    "mean_predicted": None, "pairs": 0}
        return {
            "exact_topk": self.exact / self.pairs,
            "at_least_one": self.at_least_one / self.pairs,
            "recall": self.hits / max(self.needed, 1),
            "precision": self.hits / max(self.predicted, 1),
            "mean_predicted": self.predicted / self.pairs,
            "pairs": self.pairs,
        }


@dataclass
class EvalResult:
    ahead: Tally = field(default_factory=Tally)  # target layers >= distance
    first: Tally = field(default_factory=Tally)  # target layers < distance
    per_layer: dict[int, Tally] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        out = self.ahead.figures()
        out["first_layers"] = self.first.figures()
        out["per_layer_recall"] = {str(t): tal.figures()["recall"] for t, tal in sorted(self.per_layer.items())}
        out["tokens"] = self.tokens
        out["seconds"] = round(self.seconds, 3)
        return out


def check_compatible(predictor: ExpertPredictor, trace: Trace, what: str = "the predictor") -> None:
    """The predictor's model shape against the trace's, and the tensors the predictor needs."""
    predictor.shape.check(ModelShape.from_trace(trace), what, f"the trace {trace.source}")
    if predictor.needs_hidden and trace.hidden is None:
        raise PredictorError(f"{trace.source}: the {predictor.kind} predictor needs MoE-layer inputs, but the trace "
                             "has no 'hidden' tensor (record it with `moeflow trace --hidden`)")


def evaluate(predictor: ExpertPredictor, trace: Trace, phase: str = "all") -> EvalResult:
    """Replay ``trace`` (the held-out rows) through ``predictor``; count only rows of ``phase``."""
    check_compatible(predictor, trace)
    custom = getattr(predictor, "evaluate_trace", None)  # predictors of whole paths (expertflow) replay themselves
    if custom is not None:
        return custom(trace, phase)
    L, E, d = predictor.shape.num_layers, predictor.shape.num_experts, predictor.distance
    use_embed = predictor.needs_embed and trace.embed is not None
    res = EvalResult()
    start = time.perf_counter()
    actual_all = trace.topk_mask()  # [N, L, E]
    want_phase = None if phase == "all" else (0 if phase == "prefill" else 1)
    if phase not in ("all", "prefill", "decode"):
        raise ValueError(f"phase={phase!r}: expected 'all', 'prefill' or 'decode'")
    for seq in trace.sequence_ids():
        rows = torch.nonzero(trace.seq_id == seq).flatten()
        predictor.reset()
        block = predictor.eval_block or rows.numel()
        for b0 in range(0, rows.numel(), block):
            idx = rows[b0 : b0 + block]
            keep = torch.ones(idx.numel(), dtype=torch.bool) if want_phase is None else trace.phase[idx] == want_phase
            embed = trace.embed[idx].float() if use_embed else None
            predictor.begin_iteration(embed)
            preds: dict[int, torch.Tensor] = {}
            for t in range(min(d, L)):
                preds[t] = predictor.predicted_mask(predictor.predict(t), t)
            for s in range(L):
                hidden = trace.hidden[idx, s].float() if predictor.needs_hidden else None
                predictor.observe(s, hidden, trace.probs[idx, s].float(), trace.topk_ids[idx, s])
                t = s + d
                if t < L:
                    preds[t] = predictor.predicted_mask(predictor.predict(t), t)
            predictor.end_iteration()
            if not bool(keep.any()):
                continue
            res.tokens += int(keep.sum())
            for t in range(L):
                actual = actual_all[idx[keep], t]  # [R, E]
                pred = preds[t].expand(idx.numel(), E)[keep]
                (res.first if t < d else res.ahead).add(pred, actual)
                res.per_layer.setdefault(t, Tally()).add(pred, actual)
    predictor.reset()
    res.seconds = time.perf_counter() - start
    return res


def goodpred(figures: dict, distance: int, *, layer_ms: float, expert_ms: float,
             predict_ms: float = 0.0) -> dict[str, float]:
    """ProMoE's GoodPred = Accuracy x FetchRate (§4.1) of an evaluated predictor, FetchRate from a timing model.

    ``figures``: :meth:`EvalResult.as_dict`'s (precision and mean_predicted of the layers ``distance`` ahead).
    Accuracy: the share of predicted experts that were needed (precision). FetchRate: the share of one layer's
    predicted experts whose copy can finish before the layer's gate. A prediction for layer l is ready
    ``predict_ms`` after layer l - d starts; one expert copies in ``expert_ms``; a layer runs ``layer_ms``. Two
    bounds, no cache: the window (d * layer_ms - predict_ms of copy time) and the link (each layer brings one more
    target layer's predictions, so in steady state only layer_ms / expert_ms experts move per layer). With d = 1
    the prediction eats the window; ProMoE's stride (d = 2) leaves the link as the bound (its §4.3 argument)."""
    if layer_ms <= 0 or expert_ms <= 0 or predict_ms < 0:
        raise ValueError(f"goodpred: layer_ms ({layer_ms}) and expert_ms ({expert_ms}) must be > 0, predict_ms "
                         f"({predict_ms}) >= 0")
    accuracy, predicted = figures.get("precision"), figures.get("mean_predicted")
    if accuracy is None or not predicted:
        return {"accuracy": float("nan"), "fetch_rate": float("nan"), "goodpred": float("nan")}
    window = max(0.0, distance * layer_ms - predict_ms) / expert_ms
    link = layer_ms / expert_ms
    fetch_rate = min(1.0, window / predicted, link / predicted)
    return {"accuracy": accuracy, "fetch_rate": fetch_rate, "goodpred": accuracy * fetch_rate,
            "layer_ms": layer_ms, "expert_ms": expert_ms, "predict_ms": predict_ms}
