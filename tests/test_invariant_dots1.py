"""The exact-token invariant on a dots.llm1-shaped tiny model (GLM-4.5's MoE side with Qwen3's attention: a dense
first layer, shared experts, sigmoid routing with a selection bias and expert groups, QK-norm, full rotary).
Every offload policy (the predictive ones with predictors trained on its trace), the smallest, a middle and the
largest-but-one slot count, the synchronous and the random-delay transport: the greedy tokens of "resident"."""

from __future__ import annotations

import pytest
from tiny_families import assert_keeps_resident_tokens, resident_reference

from moeflow.offload.policies import POLICY_NAMES

MOE_LAYERS, EXPERTS, TOP_K = 2, 6, 2
SHAPE = dict(num_hidden_layers=MOE_LAYERS + 1, first_k_dense_replace=1, n_routed_experts=EXPERTS, n_group=3,
             topk_group=2, num_experts_per_tok=TOP_K, num_key_value_heads=2, n_shared_experts=2,
             norm_topk_prob=True, routed_scaling_factor=2.5)
NEW_TOKENS = 8
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler"))  # fiddler: AWQ only

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return resident_reference(tmp_path_factory.mktemp("dots1_invariant"), "dots1", seed=7, gen_seed=2,
                              padded_row=1, pad=2, new_tokens=NEW_TOKENS, **SHAPE)


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, (TOP_K, MOE_LAYERS * EXPERTS // 2, MOE_LAYERS * EXPERTS - 1),
                                 NEW_TOKENS)
