"""The exact-token invariant on a gpt-oss-shaped tiny model (sink attention, sliding/full layers, biased
top-k-then-softmax router, biased clamped-SwiGLU experts): every offload policy, at every slot count from the
minimum to all experts, with the synchronous and the random-delay transport, generates the greedy tokens of
"resident" - with fp32 experts, and with MXFP4 experts as published for a subset of the policies (on the CPU, the
resident model and the slots computed by the native MXFP4 kernel, moeflow/kernels/cpu/mxfp4.c)."""

from __future__ import annotations

import shutil

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear
from moeflow.offload.policies import POLICY_NAMES
from moeflow.offload.predictors import train_predictor
from moeflow.tools.record import record_trace

LAYERS, EXPERTS, TOP_K = 2, 4, 2
NEW_TOKENS = 8
CPU_POLICIES = ("fiddler",)  # compute misses on the CPU: no CPU path for biased experts yet (refused, tested)
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", *CPU_POLICIES))
MXFP4_POLICIES = ("lru", "duoserve", "expertflow")  # MXFP4 bytes through host store and slots


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny gpt-oss with fp32 experts and with MXFP4 experts (the predictors trained once, shared)."""
    root = tmp_path_factory.mktemp("gpt_oss_invariant")
    shape = dict(num_hidden_layers=LAYERS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    dense = save_gpt_oss_checkpoint(make_gpt_oss_model(seed=7, **shape), root / "dense")
    mxfp4 = save_gpt_oss_checkpoint(make_gpt_oss_model(seed=7, **shape), root / "mxfp4", mxfp4=True)
    resident = MoEModel.from_pretrained(dense)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6, 8, 5)]
    trace = record_trace(resident, prompts, max_new_tokens=6, hidden=True)
    for kind, opts in (("duoserve", {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}), ("promoe", {"epochs": 2}),
                       ("finemoe", {"capacity": 64}), ("expertflow", {"epochs": 2, "seed": 0})):
        train_predictor(kind, trace, eval_fraction=0.2, **opts).save(dense / "predictors" / f"{kind}.pt")
    shutil.copytree(dense / "predictors", mxfp4 / "predictors")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    expected = {}
    for name, path in (("dense", dense), ("mxfp4", mxfp4)):
        model = MoEModel.from_pretrained(path)
        expected[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"dense": dense, "mxfp4": mxfp4}, ids, mask, expected


CASES = [("dense", p) for p in POLICIES] + [("mxfp4", p) for p in MXFP4_POLICIES]


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("experts, policy", CASES)
def test_greedy_tokens_equal_resident(checkpoints, experts, policy, transport):
    paths, ids, mask, expected = checkpoints
    for n_slots in range(TOP_K, LAYERS * EXPERTS + 1):
        model = MoEModel.from_pretrained(paths[experts], offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            model.experts.close()
        assert model.experts.fmt.kind == ("mxfp4" if experts == "mxfp4" else "dense")
        if experts == "mxfp4" and model.experts.pool.device.type == "cpu" and native_available():
            assert model.experts.fmt.cpu_kernels  # device="cpu": resident and slots on mxfp4.c
            assert isinstance(model.model.layers[0].self_attn.q_proj, CpuQuantLinear)  # int8 attention (auto)
        assert torch.equal(out, expected[experts]), f"{policy}/{transport} with {n_slots} slots: {out}"
        s = model.stats
        assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        if n_slots < LAYERS * EXPERTS:
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0


@pytest.mark.parametrize("policy", CPU_POLICIES)
def test_cpu_compute_policies_are_refused_for_biased_experts(checkpoints, policy):
    paths, *_ = checkpoints
    with pytest.raises(SchedulingError, match="computes experts on the CPU, but the experts are"):
        MoEModel.from_pretrained(paths["dense"], offload=OffloadConfig(policy=policy, gpu_expert_slots=4))
