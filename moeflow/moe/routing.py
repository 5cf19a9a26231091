"""Routers: router logits -> (scores, top-k expert ids, top-k weights), as pure tensor functions.

A family describes its router with a :class:`RouterSpec`; :func:`make_router` turns the spec into the
function its MoE blocks call. Built: softmax-then-top-k (Mixtral, Qwen-MoE, OLMoE) and the grouped
routers of DeepSeek-V2 (softmax, ``group_limited_greedy``: a group scored by its best expert) and
DeepSeek-V3 / Kimi-K2 / GLM-4.5 (sigmoid scores, a selection-only bias, a group scored by the sum of its
top-2, weights from the unbiased scores). Top-k on the logits before the softmax (gpt-oss) is not built yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RouterSpec:
    """How a family turns router logits [T, E] into top-k experts and their weights."""

    top_k: int
    scoring: str = "softmax"  # "softmax" or "sigmoid": scores from the logits
    renormalize: bool = True  # divide the top-k weights by their sum
    topk_before_scoring: bool = False  # top-k on the raw logits, then the scoring over those k (gpt-oss)
    selection_bias: bool = False  # a learnt per-expert bias added to the scores for selection only (DeepSeek-V3)
    n_groups: int = 1  # experts split into groups; only the best ``topk_groups`` groups may be chosen
    topk_groups: int = 1
    scaling_factor: float = 1.0  # multiplies the final weights (routed_scaling_factor)
    router_bias: bool = False  # the router linear layer has a bias
    group_score: str = "top2_sum"  # how a group is scored for group-limited top-k: "top2_sum" (V3) or "max" (V2)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optionally renormalise.

    router_logits [T, E] -> (probs fp32 [T, E], topk_ids int32 [T, k], topk_weights fp32 [T, k]).
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, ids.to(torch.int32), weights


def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k of the raw logits, then a softmax over those k only (fp32).

    router_logits [T, E] -> (probs fp32 [T, E] (softmax over every expert, for predictors and statistics),
    topk_ids int32 [T, k], topk_weights fp32 [T, k] (sum to 1)).
    """
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    weights = F.softmax(values, dim=-1, dtype=torch.float32)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    return probs, ids.to(torch.int32), weights


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral routing (softmax, top-k, renormalise): router_logits [T, E] -> (probs, ids, weights)."""
    return softmax_topk(router_logits, top_k, renormalize=True)


def make_router(spec: RouterSpec) -> Router:
    """The routing function of ``spec``; raises NotImplementedError (naming the field) for variants not built yet.

    With ``spec.selection_bias`` the function takes the bias as a second argument: ``router(logits, bias)``.
    """
    if spec.topk_before_scoring and spec.scoring == "softmax" and not spec.selection_bias and spec.n_groups == 1:
        return _topk_then_softmax_router(spec)
    if spec.scoring == "sigmoid" or spec.n_groups > 1 or spec.selection_bias:
        return make_grouped_router(spec)
    unsupported = [name for name, value, plain in (
        ("scoring", spec.scoring, "softmax"), ("topk_before_scoring", spec.topk_before_scoring, False),
    ) if value != plain]
    if unsupported:
        raise NotImplementedError(f"router {spec}: {', '.join(unsupported)} not implemented yet (moeflow.moe.routing)")
    top_k, renormalize, scale = spec.top_k, spec.renormalize, spec.scaling_factor

    def router(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs, ids, weights = softmax_topk(router_logits, top_k, renormalize)
        return probs, ids, (weights * scale if scale != 1.0 else weights)

    return router


# ---------------------------------------------------------------- group-limited routers (the DeepSeek line)
# Experts are split into ``n_groups`` equal groups, each group gets a score, only the ``topk_groups`` best
# groups stay eligible, and the top-k experts among them are chosen; the weights are then scaled by
# ``routed_scaling_factor``.
# * DeepSeek-V2 (scoring="softmax", group_score="max"): softmax probabilities, a group scores its best expert,
#   excluded experts score 0, weights = the chosen probabilities (topk_method="greedy" is the one-group case).
# * DeepSeek-V3 / Kimi-K2 / GLM-4.5 (scoring="sigmoid", group_score="top2_sum"): sigmoid scores, a learnt
#   per-expert bias (e_score_correction_bias) added for choosing only, a group scores the sum of its two best
#   biased scores, weights = the unbiased scores of the chosen experts, renormalised when asked.

GroupedRouter = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def group_mask(choice: torch.Tensor, n_groups: int, topk_groups: int, group_score: str) -> torch.Tensor:
    """choice fp32 [T, E] -> bool [T, E]: the experts in each token's ``topk_groups`` best groups."""
    t, e = choice.shape
    grouped = choice.view(t, n_groups, e // n_groups)
    if group_score == "max":
        scores = grouped.max(dim=-1).values
    elif group_score == "top2_sum":
        scores = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)
    else:
        raise ValueError(f"group_score={group_score!r}: expected 'max' or 'top2_sum'")
    best = scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros((t, n_groups), dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return keep[:, :, None].expand(t, n_groups, e // n_groups).reshape(t, e)


def grouped_topk(
    router_logits: torch.Tensor, top_k: int, *, scoring: str, n_groups: int = 1, topk_groups: int = 1,
    group_score: str = "top2_sum", selection_bias: torch.Tensor | None = None, renormalize: bool = False,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_logits [T, E]; selection_bias fp32 [E] (added to the scores for choosing only) ->
    (scores fp32 [T, E], topk_ids int32 [T, k] best first, topk_weights fp32 [T, k])."""
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = F.softmax(logits, dim=-1)
    else:
        raise ValueError(f"scoring={scoring!r}: expected 'sigmoid' or 'softmax'")
    choice = scores if selection_bias is None else scores + selection_bias.float()
    if n_groups > 1:
        keep = group_mask(choice, n_groups, topk_groups, group_score)
        # V3 excludes with -inf; V2 zeroes the excluded probabilities (as DeepSeek's own code does)
        choice = choice.masked_fill(~keep, float("-inf") if scoring == "sigmoid" else 0.0)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return scores, ids.to(torch.int32), weights


def make_grouped_router(spec: RouterSpec) -> GroupedRouter:
    """The router of a :class:`~moeflow.moe.routing.RouterSpec` with sigmoid scores, groups or a selection bias:
    ``router(logits [T, E], selection_bias [E] | None = None) -> (scores, ids, weights)``."""
    if spec.topk_before_scoring:
        raise NotImplementedError(f"router {spec}: topk_before_scoring with grouped routing is not implemented")
    num_checks = (("n_groups", spec.n_groups), ("topk_groups", spec.topk_groups))
    for name, value in num_checks:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"router {spec}: {name}={value!r} must be a positive integer")
    if spec.topk_groups > spec.n_groups:
        raise ValueError(f"router {spec}: topk_groups={spec.topk_groups} exceeds n_groups={spec.n_groups}")
    kwargs = dict(scoring=spec.scoring, n_groups=spec.n_groups, topk_groups=spec.topk_groups,
                  group_score=spec.group_score, renormalize=spec.renormalize, scaling_factor=spec.scaling_factor)
    top_k, wants_bias = spec.top_k, spec.selection_bias

    def router(router_logits: torch.Tensor, selection_bias: torch.Tensor | None = None):
        if wants_bias and selection_bias is None:
            raise ValueError(f"router {spec}: selection_bias=True but no bias tensor was passed")
        e = router_logits.shape[-1]
        if e % spec.n_groups:
            raise ValueError(f"router {spec}: n_groups={spec.n_groups} does not divide the {e} experts")
        return grouped_topk(router_logits, top_k, selection_bias=selection_bias, **kwargs)

    return router


def _topk_then_softmax_router(spec: RouterSpec) -> Router:
    top_k, scale = spec.top_k, spec.scaling_factor

    def router(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs, ids, weights = topk_then_softmax(router_logits, top_k)
        return probs, ids, (weights * scale if scale != 1.0 else weights)

    return router
