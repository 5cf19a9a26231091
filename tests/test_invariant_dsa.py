"""The exact-token invariant on a GLM-5-shaped tiny model (DeepSeek Sparse Attention: index_topk 4 on a 14-token
prompt, a shared-indexer layer, a dense first layer, a shared expert, grouped sigmoid routing). Every offload
policy, three slot counts from the minimum to all experts, the synchronous and the random-delay transport: the
greedy tokens of "resident"; the decode step replayed as captured pieces (CUDA-graph semantics on the CPU) and
compiled (torch.compile) too."""

from __future__ import annotations

import pytest
import torch
from tiny_dsa import make_dsa_checkpoint
from tiny_families import assert_keeps_resident_tokens, train_predictors

from moeflow import MoEModel, OffloadConfig
from moeflow.offload.policies import POLICY_NAMES

MOE_LAYERS, EXPERTS, TOP_K = 2, 6, 2
SHAPE = dict(num_hidden_layers=MOE_LAYERS + 1, first_k_dense_replace=1, n_routed_experts=EXPERTS, n_group=3,
             topk_group=2, num_experts_per_tok=TOP_K, q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, index_topk=4, indexer_types=["full", "shared", "full"])
NEW_TOKENS = 8
SLOTS = (TOP_K, 7, MOE_LAYERS * EXPERTS)
# fiddler computes every non-resident expert with the CPU int4 kernels: AWQ only (tests/test_hybrid.py)
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler"))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_dsa_checkpoint(tmp_path_factory.mktemp("dsa_invariant"), "glm_moe_dsa", seed=5, **SHAPE)
    resident = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    gen = torch.Generator().manual_seed(1)
    train_predictors(resident, path, gen)
    ids = torch.randint(0, 97, (2, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the prefill needs every expert through the ring
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return path, ids, mask, expected


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, SLOTS, NEW_TOKENS, total_experts=MOE_LAYERS * EXPERTS)


def test_micro_batches_regrouped_by_expertflow(tiny):
    path, ids, mask, expected = tiny
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="expertflow", gpu_expert_slots=3))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, micro_batch_size=1)
    finally:
        model.experts.close()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=5)], ids=["resident", "lru"])
def test_captured_decode_step_gives_the_resident_tokens(tiny, offload):
    """The sparse selection (scores, top-k, scatter into the mask) holds no host read and no value-sized shape:
    the decode step captures into pieces that replay to the same tokens, twice on one cache."""
    from test_compile_cuda_graphs import HostArgs, TraceCapture, on_device

    path, ids, mask, _ = tiny
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    try:
        # no EOS: the eager loop's finished-row read would read a piece's output back (test_host_loop's rule)
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        graphs = model.capture_decode(capture_factory=TraceCapture)
        graphs.inner = on_device(model.model)
        model.use_backend(HostArgs(model.experts))
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        again = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures == 1
    assert torch.equal(got, eager) and torch.equal(again, eager)
    assert len(graphs.step.replays) == MOE_LAYERS + 1


def test_compiled_decode_step_gives_the_resident_tokens(tiny):
    """torch.compile traces the sparse selection without a graph break: all resident, the step is one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    path, ids, mask, _ = tiny
    model = MoEModel.from_pretrained(path, kernels="torch")
    try:
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        model.compile_decode(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        model.close()
        torch._dynamo.reset()
    assert not breaks and graphs == 1
    assert torch.equal(got, eager)
