"""The exact-token invariant on a tiny Qwen3-Next (Gated DeltaNet and gated-attention layers, a dense first layer, a
shared expert with a sigmoid gate) and a tiny Qwen3.5-MoE as published: every offload policy (the predictive ones
with predictors trained on its trace), the smallest, a middle and the largest-but-one slot count, the synchronous and
the random-delay transport give the greedy tokens of "resident" on a left-padded batch (the linear layers' states
never depend on where experts live)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import assert_keeps_resident_tokens, train_predictors
from tiny_hybrid import QWEN3_5_MOE, QWEN3_NEXT, make_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.offload.policies import POLICY_NAMES

# Qwen3-Next: 4 layers, layer 0 dense; Qwen3.5 as published (conditional generation): 3 layers, full attention first
SHAPES = {"qwen3_next": (QWEN3_NEXT["interval2-gqa-dense-first"], (1, 2, 3)),
          "qwen3_5_moe": (QWEN3_5_MOE["full-first-mrope"], (0, 1, 2))}
MOE_LAYERS, EXPERTS, TOP_K = 3, 6, 2
NEW_TOKENS = 8
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler"))  # fiddler: AWQ only

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny(tmp_path_factory, request):
    shape, moe_layers = SHAPES[request.param]
    path, _ = make_checkpoint(tmp_path_factory.mktemp(f"{request.param}_invariant"), request.param, seed=7, **shape)
    resident = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    assert resident.family.name == request.param and resident.family.moe_layers == moe_layers
    gen = torch.Generator().manual_seed(2)
    train_predictors(resident, path, gen)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return path, ids, mask, expected


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, (TOP_K, MOE_LAYERS * EXPERTS // 2, MOE_LAYERS * EXPERTS - 1),
                                 NEW_TOKENS)


def test_expertflow_micro_batches_in_the_dual_batch_pipeline(tiny):
    """ExpertFlow's micro-batches (regrouped each step, the next one's prediction beside the current pass) read and
    write their rows' linear-attention states: the resident tokens."""
    path, ids, mask, expected = tiny
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="expertflow", gpu_expert_slots=9))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, micro_batch_size=1)
        stats = model.runner.pipeline_stats
    finally:
        model.close()
    assert torch.equal(out, expected)
    assert stats is not None and stats.passes > 0
