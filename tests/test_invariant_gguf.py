"""The exact-token invariant on GGUF models: every caching policy (and finemoe / auto, which need no trained file),
at slot counts from the minimum to all experts, with the synchronous and the random-delay transport, generates
exactly the greedy tokens of "resident" on the same file. Two files of one tiny Qwen3-MoE: Q4_0 experts (the AWQ
format, the same codes and scales) and Q4_0 / Q8_0 layers (the GGUF format: each expert's blocks as stored, run by
the GGUF kernels' torch reference here). ~40 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from family_models import make_family_model  # noqa: E402
from gguf_models import T, write_gguf  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402

EXPERTS, TOP_K, LAYERS = 16, 4, 2
ALL_SLOTS = LAYERS * EXPERTS
SLOT_COUNTS = (TOP_K, TOP_K + 1, 2 * TOP_K, ALL_SLOTS - 1, ALL_SLOTS)
NEW_TOKENS = 4
POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "finemoe", "auto")
SHAPE = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
             num_key_value_heads=1, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)


@pytest.fixture(scope="module", params=["q4_0-awq", "mixed-gguf"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_invariant")
    types = T.Q4_0 if request.param == "q4_0-awq" else [T.Q4_0, T.Q8_0]
    path = root / "m.gguf"
    write_gguf(make_family_model("qwen3_moe", seed=12, **SHAPE), path, expert_types=types, other_type=T.Q8_0)
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    resident = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(policy="resident"))
    assert resident.experts.fmt.kind == ("awq" if request.param == "q4_0-awq" else "gguf")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
    resident.close()
    yield path, ids, mask, expected
    mp.undo()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    path, ids, mask, expected = tiny
    for n_slots in SLOT_COUNTS:
        model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.2, seed=n_slots))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
            assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
            s = model.stats
            assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
            if n_slots < ALL_SLOTS:
                assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0
        finally:
            model.close()
