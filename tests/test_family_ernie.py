"""ERNIE-4.5 MoE through ``moeflow.MoEModel`` against transformers' ``Ernie4_5_MoeForCausalLM`` on tiny random
checkpoints (fp32 logits within 1e-4, 32 greedy tokens), the exact-token invariant for every offload policy, AWQ, and
the config.json variants refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_families import assert_matches_transformers, offloaded_generate, train_predictors

from moeflow import MoEModel, OffloadConfig
from moeflow.errors import CheckpointError
from moeflow.offload.policies import POLICY_NAMES

transformers = pytest.importorskip("transformers")
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=256, moe_num_experts=6, moe_k=2, use_bias=False)
CONFIGS = {
    "gqa-dense-first-shared": dict(num_key_value_heads=2, moe_layer_start_index=1, moe_layer_end_index=2,
                                   moe_num_shared_experts=2, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mha-all-moe-untied": dict(num_key_value_heads=4, moe_layer_start_index=0, moe_layer_end_index=2,
                               moe_num_shared_experts=0, tie_word_embeddings=False, moe_k=3),
}


def make_checkpoint(directory: Path, seed: int = 0, **overrides):
    """A random Ernie4_5_MoeForCausalLM (fp32) saved to ``directory``, weights scaled so routing is far from ties
    and the selection bias matters; returns (directory, model)."""
    cfg = transformers.Ernie4_5_MoeConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.Ernie4_5_MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)
    model.save_pretrained(directory)
    return directory, model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    _, ref = make_checkpoint(tmp_path, seed=1, **CONFIGS[name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == "ernie4_5_moe"
    assert model.family.moe_layers == tuple(range(CONFIGS[name]["moe_layer_start_index"], 3))
    assert_matches_transformers(model, ref)


@pytest.mark.parametrize(("change", "match"), [
    ({"moe_layer_interval": 2}, "MoE layers every 2"),
    ({"moe_layer_end_index": 1}, "moe_layer_end_index=1"),
    ({"moe_num_experts": [6, 6]}, "per-modality list"),
    ({"use_bias": True}, "use_bias=true"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, match):
    make_checkpoint(tmp_path, **CONFIGS["gqa-dense-first-shared"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("ernie_invariant"), seed=4, **CONFIGS["gqa-dense-first-shared"])
    resident = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    gen = torch.Generator().manual_seed(3)
    train_predictors(resident, path, gen)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return path, ids, mask, resident.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p not in ("resident", "fiddler")])
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    """Every policy but fiddler (AWQ only; above), the predictive ones with predictors trained on the resident
    model's trace, at the smallest, a middle and the largest-but-one slot count."""
    path, ids, mask, expected = tiny
    for n_slots in (2, 6, 11):
        out, stats = offloaded_generate(path, ids, mask, policy, transport, n_slots, 8)
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots"
        assert stats.decode.hits + stats.decode.misses > 0


def test_awq_checkpoint_matches_transformers_on_dequantized_weights(tmp_path):
    """``moeflow quantize`` of an ERNIE checkpoint (experts to AWQ group 32) loads with its routed experts in the
    AWQ pool and computes what transformers computes on the dequantized experts."""
    from safetensors.torch import load_file

    from moeflow.quant.awq import dequantize
    from moeflow.tools.quantize import quantize_checkpoint

    src, ref = make_checkpoint(tmp_path / "src", seed=2, **CONFIGS["gqa-dense-first-shared"])
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=32, progress=False)
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    # transformers' model carrying exactly the quantized experts (dequantized): the same logits, 32 tokens
    sd = load_file(dst / "model.safetensors")
    # every other tensor as the quantizer saved it (fp16); the bias under transformers' module path
    state = {k.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics."): v.float() for k, v in sd.items()
             if ".mlp.experts." not in k}
    for layer in model.family.moe_layers:
        base = f"model.layers.{layer}.mlp.experts"
        w = [{p: dequantize(sd[f"{base}.{e}.{p}.qweight"], sd[f"{base}.{e}.{p}.qzeros"],
                            sd[f"{base}.{e}.{p}.scales"].float(), 32).T for p in ("gate_proj", "up_proj", "down_proj")}
             for e in range(BASE["moe_num_experts"])]
        state[f"{base}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in w])
        state[f"{base}.down_proj"] = torch.stack([x["down_proj"] for x in w])
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [n for n in missing if n != "lm_head.weight"], (missing, unexpected)
    assert_matches_transformers(model, ref.eval())
