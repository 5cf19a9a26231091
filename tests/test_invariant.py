"""The invariant: every offload policy, at every slot count from the minimum to all experts, with the
synchronous and the random-delay transport, generates exactly the greedy tokens of "resident" on a left-padded
batch of unequal lengths (tests/test_invariant_padding.py: the padding never reaches an expert)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_awq_checkpoint, make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import SchedulingError

LAYERS, EXPERTS, TOP_K = 2, 4, 2
NEW_TOKENS = 16
OFFLOAD_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_invariant"), seed=11, num_hidden_layers=LAYERS, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    gen = torch.Generator().manual_seed(0)
    # three prompts of different lengths (left padding, which reaches no expert): the prefill needs every expert
    # through the ring
    ids = torch.randint(0, 97, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :7] = 0
    resident = MoEOffloadedMixtral.from_pretrained(path, device="cpu", dtype=torch.float32,
                                                   offload=OffloadConfig(policy="resident"))
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return path, ids, mask, expected


def _generate(path, ids, mask, **config):
    model = MoEOffloadedMixtral.from_pretrained(path, device="cpu", dtype=torch.float32,
                                                offload=OffloadConfig(**config))
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False), model
    finally:
        if hasattr(model.experts, "close"):
            model.experts.close()


@pytest.mark.parametrize("early_hits", [False, True])  # True: each layer's hits launched before its read-back
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport, early_hits):
    path, ids, mask, expected = tiny
    for n_slots in range(max(TOP_K, 2), LAYERS * EXPERTS + 1):
        out, model = _generate(path, ids, mask, policy=policy, gpu_expert_slots=n_slots, transport=transport,
                               random_delay_ms=0.3, seed=n_slots, early_hits=early_hits)
        assert model.experts.early_hits is early_hits
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
        s = model.stats
        assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        if n_slots < LAYERS * EXPERTS or policy == "ondemand":
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0


def test_below_minimum_is_refused(tiny):
    path, *_ = tiny
    with pytest.raises(SchedulingError, match="minimum is 2"):
        MoEOffloadedMixtral.from_pretrained(path, device="cpu", dtype=torch.float32,
                                            offload=OffloadConfig(policy="lru", gpu_expert_slots=1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real streams, events, pinning)")
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_cuda_streams_keep_the_tokens(tiny, kernels):
    from moeflow.offload import CudaTransport

    path, ids, mask, _ = tiny
    load = dict(device="cuda", dtype=torch.float16, kernels=kernels)
    # resident and every policy loaded alike (CUDA graphs by default, the bucketed cache): only offloading differs
    resident = MoEOffloadedMixtral.from_pretrained(path, **load, offload=OffloadConfig(policy="resident"))
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    for policy in OFFLOAD_POLICIES:
        for n_slots in range(max(TOP_K, 2), LAYERS * EXPERTS + 1):
            model = MoEOffloadedMixtral.from_pretrained(
                path, **load, offload=OffloadConfig(policy=policy, gpu_expert_slots=n_slots, max_inflight_chunks=1)
            )
            assert isinstance(model.experts.transport, CudaTransport)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            model.experts.close()
            assert torch.equal(out.cpu(), expected.cpu()), f"{policy} with {n_slots} slots on CUDA"


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    """AWQ experts on the CPU: the reference is the resident CPU int4 path (``CpuInt4Experts``)."""
    awq = make_tiny_awq_checkpoint(tmp_path_factory.mktemp("tiny_invariant_awq"), seed=11, num_hidden_layers=LAYERS,
                                   num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    resident = MoEOffloadedMixtral.from_pretrained(awq, offload=OffloadConfig(policy="resident"))
    assert resident.kernels == "cpu-int4" and type(resident.experts).__name__ == "CpuInt4Experts"
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return awq, ids, mask, expected


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize(("policy", "cpu_compute"), [*((p, None) for p in OFFLOAD_POLICIES), ("fiddler", None),
                                                     ("lru", "always")])
def test_cpu_int4_slots_give_the_resident_cpu_int4_tokens(tiny_awq, policy, cpu_compute, transport):
    """kernels="auto" on the CPU with AWQ experts: the host store and the slots hold torch's int4 form, so every
    policy at every slot count computes the resident CPU int4 path's bytes with its kernels: the same tokens
    (misses computed on the CPU by hybrid execution included: they read the same form in the host store)."""
    from moeflow.offload.cpu_slots import CpuInt4Format

    path, ids, mask, expected = tiny_awq
    for n_slots in range(max(TOP_K, 2), LAYERS * EXPERTS + 1):
        model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots,
            cpu_compute=cpu_compute))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            model.close()
        assert isinstance(model.experts.fmt, CpuInt4Format) and model.experts.int4_slots is not None
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
        s = model.stats
        if policy == "fiddler" or cpu_compute == "always":  # misses on the CPU, from the host store's int4 form
            assert n_slots == LAYERS * EXPERTS or s.prefill.cpu_experts + s.decode.cpu_experts > 0
        elif n_slots < LAYERS * EXPERTS:
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0
