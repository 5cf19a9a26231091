"""The exact-token invariant on a Qwen3-MoE GGUF with Q4_K_M's expert mixture (issue 39's "done when": a Q4_K_M
Qwen3-MoE offloaded by every policy gives the dequantized reference's greedy tokens). Experts as llama-quantize's
Q4_K_M writes them (Q4_K gate/up; Q6_K down in one layer, Q4_K in the other: hand-made blocks,
``gguf_models.k_mix_experts``), attention Q8_0. Every caching policy (and finemoe / auto) x the synchronous and
random-delay transports x slot counts from the minimum to all experts = "resident" on the same file (resident
against the dequantized weights: tests/test_gguf_models.py); on the CPU kernels the experts as views of the mapped file,
copied, and offloaded: the same tokens. ~17 s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from family_models import make_family_model  # noqa: E402
from gguf_models import T, k_mix_experts, write_gguf  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402

EXPERTS, TOP_K, LAYERS = 6, 2, 2
ALL_SLOTS = LAYERS * EXPERTS
SLOT_COUNTS = (TOP_K, TOP_K + 1, ALL_SLOTS - 1)
POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "finemoe", "auto")
MIX = [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")]  # Q4_K_M: more bits for the down projections of some layers


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_q4_k_m")
    path = root / "m.gguf"
    model = make_family_model("qwen3_moe", seed=3, hidden_size=256, moe_intermediate_size=256,
                              num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                              num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0,
               raw_experts=k_mix_experts(MIX, EXPERTS, 256, 256))
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    resident = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(policy="resident"))
    assert resident.experts.fmt.kind == "gguf"  # the blocks as stored, not dequantized
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=[])
    resident.close()
    yield path, ids, mask, expected
    mp.undo()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_q4_k_m_greedy_tokens_equal_resident(q4_k_m, policy, transport):
    path, ids, mask, expected = q4_k_m
    for n_slots in SLOT_COUNTS:
        model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.2, seed=n_slots))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=[])
            assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
            assert model.stats.prefill.bytes_h2d + model.stats.decode.bytes_h2d > 0
        finally:
            model.close()


def test_q4_k_m_mapped_on_the_cpu_kernels(q4_k_m):
    """On ``device="cpu"`` with the CPU kernels (``kernels="auto"``): the resident experts as views of the mapped
    file (``mmap=True``, the default), copied into a pool (``mmap=False``) and offloaded (lru, slots copied from the
    host store) give the same greedy tokens (the CPU kernels' int8 activations: their own reference, not the torch
    one above)."""
    from moeflow.engine.mapped_experts import MappedGGUFExperts

    path, ids, mask, _ = q4_k_m
    outs = {}
    for name, kw in (("mapped", {}), ("copied", {"mmap": False}),
                     ("lru", {"offload": OffloadConfig(policy="lru", gpu_expert_slots=TOP_K + 1)})):
        model = MoEModel.from_pretrained(path, device="cpu", **kw)
        try:
            assert model.experts.fmt.cpu_kernels
            assert (type(model.experts) is MappedGGUFExperts) == (name == "mapped")
            outs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=[])
        finally:
            model.close()
    assert torch.equal(outs["mapped"], outs["copied"]) and torch.equal(outs["lru"], outs["copied"]), outs
