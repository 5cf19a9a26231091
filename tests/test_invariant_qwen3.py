"""The exact-token invariant on a Qwen3-MoE-shaped tiny model (64 experts, top-8, a dense layer between the
MoE layers): every offload policy, at slot counts from the minimum to all experts, with the synchronous and
the random-delay transport, generates exactly the greedy tokens of "resident"."""

from __future__ import annotations

import pytest
import torch
from family_models import make_family_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.offload.predictors import train_predictor
from moeflow.tools.record import record_trace

EXPERTS, TOP_K = 64, 8
MOE_LAYERS = 2  # decoder layers 0 and 2; layer 1 is a dense MLP
ALL_SLOTS = MOE_LAYERS * EXPERTS
SLOT_COUNTS = (TOP_K, TOP_K + 1, 2 * TOP_K, 40, ALL_SLOTS - 1, ALL_SLOTS)
NEW_TOKENS = 4
CACHES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")
PRESETS = ("duoserve", "promoe", "finemoe", "auto", "expertflow")
SHAPE = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=24, num_hidden_layers=3,
             mlp_only_layers=[1], num_attention_heads=2, num_key_value_heads=1, num_experts=EXPERTS,
             num_experts_per_tok=TOP_K, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("qwen3_invariant"), "qwen3_moe", seed=12, **SHAPE)
    resident = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6, 8, 5)]
    trace = record_trace(resident, prompts, max_new_tokens=4, hidden=True)
    for kind, opts in (("duoserve", {"epochs": 1, "widths": [32, 16, 16, 8, 8, 8]}), ("promoe", {"epochs": 1}),
                       ("finemoe", {"capacity": 64}), ("expertflow", {"epochs": 1, "vocab_size": 97})):
        train_predictor(kind, trace, eval_fraction=0.2, **opts).save(path / "predictors" / f"{kind}.pt")
    ids = torch.randint(0, 97, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
    return path, ids, mask, expected


def _generate(path, ids, mask, **config):
    if config["policy"] == "expertflow":
        config["predictor_path"] = str(path / "predictors" / "expertflow.pt")
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(**config))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        return out, model
    finally:
        model.close()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", CACHES + PRESETS)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    path, ids, mask, expected = tiny
    for n_slots in SLOT_COUNTS:
        out, model = _generate(path, ids, mask, policy=policy, gpu_expert_slots=n_slots, transport=transport,
                               random_delay_ms=0.2, seed=n_slots)
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
        s = model.stats
        assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        if n_slots < ALL_SLOTS:
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0
