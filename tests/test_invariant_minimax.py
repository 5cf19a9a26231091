"""The exact-token invariant on a MiniMax-M2-shaped tiny model (every layer MoE, sigmoid routing choosing with a
selection bias, QK-norm over the whole projection, partial rotary). Every offload policy (the predictive ones with
predictors trained on its trace), the smallest, a middle and the largest-but-one slot count, the synchronous and
the random-delay transport: the greedy tokens of "resident"."""

from __future__ import annotations

import pytest
from tiny_families import MINIMAX_M2, assert_keeps_resident_tokens, resident_reference

from moeflow.offload.policies import POLICY_NAMES

MOE_LAYERS, EXPERTS, TOP_K = 2, 6, 2
SHAPE = dict(MINIMAX_M2["qk-norm-partial-rotary"], num_hidden_layers=MOE_LAYERS, num_local_experts=EXPERTS,
             num_experts_per_tok=TOP_K)
NEW_TOKENS = 8
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler"))  # fiddler: AWQ only

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return resident_reference(tmp_path_factory.mktemp("minimax_invariant"), "minimax_m2", seed=7, gen_seed=2,
                              padded_row=1, pad=2, new_tokens=NEW_TOKENS, **SHAPE)


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, (TOP_K, MOE_LAYERS * EXPERTS // 2, MOE_LAYERS * EXPERTS - 1),
                                 NEW_TOKENS)
