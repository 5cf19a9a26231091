"""Group-limited routers (DeepSeek-V2 / V3, GLM-4.5) against transformers' own routers on random logits."""

from __future__ import annotations

import pytest
import torch

from moeflow.moe import RouterSpec, make_router
from moeflow.moe.block import MoEBlock

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter  # noqa: E402


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by expert id (transformers' top-k is unsorted)."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.gather(1, order)


def hf_v3_router(cls, E, k, groups, topk_groups, norm, scale, H=16, seed=0):
    cfg_cls = {DeepseekV3TopkRouter: transformers.DeepseekV3Config, Glm4MoeTopkRouter: transformers.Glm4MoeConfig}[cls]
    cfg = cfg_cls(hidden_size=H, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                  topk_group=topk_groups,                   norm_topk_prob=norm, routed_scaling_factor=scale)
    router = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.5)
    return router


V3_CASES = [  # (E, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    (16, 4, 4, 2, True, 2.5), (16, 4, 4, 2, False, 1.0), (32, 8, 8, 3, True, 1.8), (12, 2, 1, 1, True, 1.0),
    (24, 6, 6, 6, False, 0.7), (8, 8, 2, 2, True, 2.0),
]


@pytest.mark.parametrize("cls", [DeepseekV3TopkRouter, Glm4MoeTopkRouter])
@pytest.mark.parametrize("E,k,groups,topk_groups,norm,scale", V3_CASES)
def test_sigmoid_grouped_router_matches_transformers(cls, E, k, groups, topk_groups, norm, scale):
    hf = hf_v3_router(cls, E, k, groups, topk_groups, norm, scale)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(E + k))
    hf_logits, hf_w, hf_ids = hf(x)
    spec = RouterSpec(top_k=k, scoring="sigmoid", renormalize=norm, selection_bias=True, n_groups=groups,
                      topk_groups=topk_groups, scaling_factor=scale)
    scores, ids, weights = make_router(spec)(hf_logits, hf.e_score_correction_bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.allclose(scores, hf_logits.sigmoid())
    ours, theirs = by_id(ids, weights), by_id(hf_ids, hf_w)
    assert torch.equal(ours[0], theirs[0])
    assert torch.allclose(ours[1], theirs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,E,k,groups,topk_groups,scale", [
    ("greedy", 16, 4, None, None, 1.0), ("greedy", 10, 3, None, None, 16.0),
    ("group_limited_greedy", 16, 4, 4, 2, 16.0), ("group_limited_greedy", 32, 6, 8, 3, 1.0),
    ("group_limited_greedy", 12, 2, 3, 1, 2.5),
])
def test_softmax_grouped_router_matches_transformers_v2(method, E, k, groups, topk_groups, scale):
    cfg = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=E,
                                        num_experts_per_tok=k, n_group=groups, topk_group=topk_groups,
                                        topk_method=method, routed_scaling_factor=scale)
    hf = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(E)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, 16, generator=g))
    x = torch.randn(41, 16, generator=g)
    hf_logits, hf_w, hf_ids = hf(x)
    spec = RouterSpec(top_k=k, scoring="softmax", renormalize=False, n_groups=groups or 1,
                      topk_groups=topk_groups or 1, group_score="max", scaling_factor=scale)
    probs, ids, weights = make_router(spec)(hf_logits)
    assert torch.allclose(probs, hf_logits.softmax(-1))
    ours, theirs = by_id(ids, weights), by_id(hf_ids, hf_w)
    assert torch.equal(ours[0], theirs[0])
    assert torch.allclose(ours[1], theirs[1], rtol=0, atol=1e-6)


def test_the_bias_chooses_but_never_weighs():
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    spec = RouterSpec(top_k=1, scoring="sigmoid", renormalize=False, selection_bias=True)
    scores, ids, weights = make_router(spec)(logits, bias)
    assert ids.tolist() == [[2]] and torch.allclose(weights, torch.tensor([[0.5]]))


def test_moe_block_routes_with_its_checkpoint_bias():
    spec = RouterSpec(top_k=2, scoring="sigmoid", selection_bias=True, n_groups=2, topk_groups=1)
    block = MoEBlock(8, 8, spec, 0, torch.float32)
    assert block.gate.e_score_correction_bias.shape == (8,)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.e_score_correction_bias.copy_(torch.arange(8.0))
    _, ids, _ = block.route(block.gate(torch.randn(3, 8)))
    assert sorted(ids[0].tolist()) == [6, 7]


def test_grouped_router_rejects_bad_groups():
    with pytest.raises(ValueError, match="n_groups=3 does not divide the 8 experts"):
        make_router(RouterSpec(top_k=2, scoring="sigmoid", n_groups=3, topk_groups=1))(torch.randn(2, 8))
    with pytest.raises(ValueError, match="topk_groups=5 exceeds n_groups=4"):
        make_router(RouterSpec(top_k=2, scoring="sigmoid", n_groups=4, topk_groups=5))
    with pytest.raises(ValueError, match="selection_bias"):
        make_router(RouterSpec(top_k=2, scoring="sigmoid", selection_bias=True))(torch.randn(2, 8))
