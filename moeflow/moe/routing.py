"""Routers: router logits -> (scores, top-k expert ids, top-k weights), as pure tensor functions.

A family describes its router with a :class:`RouterSpec`; :func:`make_router` turns the spec into the
function its MoE blocks call. Only softmax-then-top-k (Mixtral, Qwen-MoE, OLMoE) is implemented; the
other fields name what later families need (sigmoid scores, a selection-only bias, expert groups, a
scaling factor, top-k on the logits before the softmax) so that adding one is adding a function here.
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
    """The routing function of ``spec``; raises NotImplementedError (naming the field) for variants not built yet."""
    if spec.topk_before_scoring and spec.scoring == "softmax" and not spec.selection_bias and spec.n_groups == 1:
        return _topk_then_softmax_router(spec)
    unsupported = [name for name, value, plain in (
        ("scoring", spec.scoring, "softmax"), ("topk_before_scoring", spec.topk_before_scoring, False),
        ("selection_bias", spec.selection_bias, False), ("n_groups", spec.n_groups, 1),
    ) if value != plain]
    if unsupported:
        raise NotImplementedError(f"router {spec}: {', '.join(unsupported)} not implemented yet (moeflow.moe.routing)")
    top_k, renormalize, scale = spec.top_k, spec.renormalize, spec.scaling_factor

    def router(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs, ids, weights = softmax_topk(router_logits, top_k, renormalize)
        return probs, ids, (weights * scale if scale != 1.0 else weights)

    return router


def _topk_then_softmax_router(spec: RouterSpec) -> Router:
    top_k, scale = spec.top_k, spec.scaling_factor

    def router(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs, ids, weights = topk_then_softmax(router_logits, top_k)
        return probs, ids, (weights * scale if scale != 1.0 else weights)

    return router
