"""The exact-token invariant for biased AWQ experts computed by the grouped AWQ Triton kernels (interpreted): a
tiny gpt-oss converted by ``moeflow quantize`` (AWQ gate/up/down, biases kept, clamped SwiGLU) generates, under
offload policies at several slot counts and both transports, the greedy tokens of its all-resident run, every
expert computed by the kernels' bias + clamped-SwiGLU epilogue (no plain-torch fallback)."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.offload.predictors import train_predictor
from moeflow.tools.quantize import quantize_checkpoint
from moeflow.tools.record import record_trace

LAYERS, EXPERTS, TOP_K = 2, 4, 2
NEW_TOKENS = 5
# the interpreter runs every kernel launch in Python: a subset of policy x transport, each at two slot counts
CASES = [("lru", "sync"), ("duoserve", "sync"), ("expertflow", "random-delay"), ("mixtral-offloading", "random-delay")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_awq_invariant")
    model = make_gpt_oss_model(seed=11, num_hidden_layers=LAYERS, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K)
    src = save_gpt_oss_checkpoint(model, root / "src")
    path = quantize_checkpoint(src, root / "awq", group_size=32, dtype=torch.float16, progress=False)
    reference = MoEModel.from_pretrained(path, kernels="torch")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6)]
    trace = record_trace(reference, prompts, max_new_tokens=4, hidden=True)
    for kind, opts in (("duoserve", {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}),
                       ("expertflow", {"epochs": 2, "seed": 0})):
        train_predictor(kind, trace, eval_fraction=0.2, **opts).save(path / "predictors" / f"{kind}.pt")
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*plain-torch reference")  # the kernel path applies
        resident = MoEModel.from_pretrained(path, kernels="triton")
        expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert resident.experts.fmt.kind == "awq" and resident.experts.fmt.bias
    return path, ids, mask, expected


@pytest.mark.parametrize("policy, transport", CASES)
def test_greedy_tokens_equal_resident(awq_checkpoint, policy, transport):
    path, ids, mask, expected = awq_checkpoint
    for n_slots in (TOP_K, 5):
        model = MoEModel.from_pretrained(path, kernels="triton", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*plain-torch reference")
                out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            model.experts.close()
        assert model.experts.fmt.kind == "awq"
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out}"
        assert model.stats.prefill.bytes_h2d + model.stats.decode.bytes_h2d > 0
