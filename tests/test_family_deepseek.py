"""DeepSeek-V2 / V3, GLM-4.5 and dots.llm1 through ``moeflow.MoEModel`` against transformers on tiny random
checkpoints (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_families import DEEPSEEK_V2, DEEPSEEK_V3, DOTS1, GLM4_MOE, assert_matches_transformers, make_checkpoint

from moeflow import MoEModel

pytest.importorskip("transformers")
CASES = [("deepseek_v3", n) for n in DEEPSEEK_V3] + [("deepseek_v2", n) for n in DEEPSEEK_V2] + \
    [("glm4_moe", n) for n in GLM4_MOE] + [("dots1", n) for n in DOTS1]
CONFIGS = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "glm4_moe": GLM4_MOE, "dots1": DOTS1}


@pytest.mark.parametrize("kind,name", CASES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind, name):
    _, ref = make_checkpoint(tmp_path, kind, seed=1, **CONFIGS[kind][name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == kind
    assert_matches_transformers(model, ref)


def test_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    _, ref = make_checkpoint(tmp_path, "deepseek_v3", seed=2, **DEEPSEEK_V3["no-qlora-unnormalised"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))  # as Kimi-K2 declares
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.family.name == "deepseek_v3" and model.family.moe_layers == (0, 1, 2)
    assert_matches_transformers(model, ref, new_tokens=16)


@pytest.mark.parametrize("model_type,drop", [("deepseek_v3", "kv_lora_rank"), ("glm4_moe", "moe_intermediate_size"),
                                             ("deepseek_v2", "n_routed_experts"), ("dots1", "n_routed_experts")])
def test_missing_config_fields_are_named(tmp_path, model_type, drop):
    from moeflow.errors import CheckpointError

    kind = "deepseek_v3" if model_type == "deepseek_v3" else model_type
    make_checkpoint(tmp_path, kind, **CONFIGS[kind][next(iter(CONFIGS[kind]))])
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop(drop)
    config.pop("num_local_experts", None)
    config.pop("num_experts", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"missing required field.*{drop}"):
        MoEModel.from_pretrained(tmp_path)


def test_read_routers_reads_only_the_moe_layers(tmp_path):
    from moeflow.engine.loading import read_routers

    _, ref = make_checkpoint(tmp_path, "deepseek_v3", **DEEPSEEK_V3["qlora-groups-dense"])  # layer 0 is dense
    weights, top_k = read_routers(tmp_path)
    assert top_k == 2 and len(weights) == 2
    assert torch.equal(weights[0], ref.model.layers[1].mlp.gate.weight.detach().float())


def test_dots1_sliding_window_layers_are_refused_by_name(tmp_path):
    from moeflow.errors import CheckpointError

    make_checkpoint(tmp_path, "dots1", **DOTS1["groups-dense-shared"])
    config = json.loads((tmp_path / "config.json").read_text())
    layer_types = ["full_attention", "sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": layer_types, "sliding_window": 16}))
    with pytest.raises(CheckpointError, match=r"dots1 layers \[1\] use sliding-window attention"):
        MoEModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("dense_layers", [1, 0])
def test_glm4_moe_lite_reads_as_deepseek_v3(tmp_path, dense_layers):
    """GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's layers, its dense layers given by ``mlp_layer_types``."""
    kinds = ["dense"] * dense_layers + ["sparse"] * (3 - dense_layers)
    _, ref = make_checkpoint(tmp_path, "glm4_moe_lite", seed=4, q_lora_rank=24, n_group=2, topk_group=1,
                             n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.8,
                             mlp_layer_types=kinds)
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.family.name == "deepseek_v3" and model.family.moe_layers == tuple(range(dense_layers, 3))
    assert_matches_transformers(model, ref)


@pytest.mark.parametrize(("change", "match"), [
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "not dense layers followed by sparse"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
])
def test_glm4_moe_lite_unsupported_configs_are_named(tmp_path, change, match):
    from moeflow.errors import CheckpointError

    make_checkpoint(tmp_path, "glm4_moe_lite", mlp_layer_types=["dense", "sparse", "sparse"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)
