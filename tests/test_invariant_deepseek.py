"""The exact-token invariant on a DeepSeek-V3-shaped tiny model: a dense first layer, then MoE layers with a shared
expert, sigmoid routing with a selection bias and expert groups. Every offload policy, every slot count from
the minimum to all experts, the synchronous and the random-delay transport: the greedy tokens of "resident"."""

from __future__ import annotations

import pytest
import torch
from tiny_families import assert_keeps_resident_tokens, resident_reference

from moeflow import MoEModel, OffloadConfig
from moeflow.offload.policies import POLICY_NAMES

MOE_LAYERS, EXPERTS, TOP_K = 2, 6, 2
SHAPE = dict(num_hidden_layers=MOE_LAYERS + 1, first_k_dense_replace=1, n_routed_experts=EXPERTS, n_group=3,
             topk_group=2, num_experts_per_tok=TOP_K, q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True,
             routed_scaling_factor=2.5)
NEW_TOKENS = 8
# fiddler computes every non-resident expert with the CPU int4 kernels: AWQ only (tests/test_hybrid.py)
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler"))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # left padding: the prefill needs every expert through the ring
    return resident_reference(tmp_path_factory.mktemp("deepseek_invariant"), "deepseek_v3", seed=5, gen_seed=1,
                              padded_row=1, pad=3, new_tokens=NEW_TOKENS, **SHAPE)


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, range(TOP_K, MOE_LAYERS * EXPERTS + 1), NEW_TOKENS,
                                 total_experts=MOE_LAYERS * EXPERTS)


def test_micro_batches_regrouped_by_expertflow(tiny):
    path, ids, mask, expected = tiny
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="expertflow", gpu_expert_slots=3))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, micro_batch_size=1)
    finally:
        model.experts.close()
    assert torch.equal(out, expected)
