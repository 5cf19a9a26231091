"""Bad Qwen/OLMoE checkpoints get errors naming the model type, tensor or config field at fault."""

from __future__ import annotations

import json

import pytest
from family_models import make_family_checkpoint
from safetensors.torch import load_file, save_file

from moeflow import CheckpointError, MoEModel
from moeflow.families import supported_model_types


def edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


def drop_tensor(directory, name):
    sd = load_file(directory / "model.safetensors")
    del sd[name]
    save_file(sd, directory / "model.safetensors")


def test_unsupported_model_type_names_it_and_the_supported_list(tmp_path):
    ckpt = make_family_checkpoint(tmp_path, "olmoe")
    edit_config(ckpt, model_type="jamba")
    with pytest.raises(CheckpointError, match="model_type 'jamba' is not supported") as err:
        MoEModel.from_pretrained(ckpt)
    for model_type in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"):
        assert model_type in supported_model_types() and model_type in str(err.value)


def test_missing_shared_expert_tensor_is_named(tmp_path):
    ckpt = make_family_checkpoint(tmp_path, "qwen2_moe")
    drop_tensor(ckpt, "model.layers.1.mlp.shared_expert.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.shared_expert\.up_proj\.weight"):
        MoEModel.from_pretrained(ckpt)
    ckpt2 = make_family_checkpoint(tmp_path / "gate", "qwen2_moe")
    drop_tensor(ckpt2, "model.layers.0.mlp.shared_expert_gate.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.shared_expert_gate\.weight"):
        MoEModel.from_pretrained(ckpt2)


@pytest.mark.parametrize("model_type,key", [("qwen3_moe", "num_local_experts"), ("olmoe", "num_experts")])
def test_expert_count_disagreeing_with_config_names_both(tmp_path, model_type, key):
    ckpt = make_family_checkpoint(tmp_path, model_type)  # 8 experts per layer
    edit_config(ckpt, **{key: 6})
    with pytest.raises(CheckpointError, match=rf"holds 8 experts .* config\.json says {key}=6"):
        MoEModel.from_pretrained(ckpt)
    edit_config(ckpt, **{key: 10})
    with pytest.raises(CheckpointError, match=rf"holds 8 experts .* config\.json says {key}=10"):
        MoEModel.from_pretrained(ckpt)


def test_fused_expert_count_disagreeing_with_config_names_both(tmp_path):
    from test_families import fuse_experts

    per = make_family_checkpoint(tmp_path / "per", "qwen3_moe")
    fused = fuse_experts(per, tmp_path / "fused", 2, 8)
    edit_config(fused, num_local_experts=None, num_experts=7)
    with pytest.raises(CheckpointError,
                       match=r"holds 8 experts \(.*gate_up_proj\) but config\.json says num_experts=7"):
        MoEModel.from_pretrained(fused)


def test_both_expert_count_spellings_must_agree(tmp_path):
    ckpt = make_family_checkpoint(tmp_path, "qwen3_moe")
    edit_config(ckpt, num_experts=4)  # transformers wrote num_local_experts=8
    with pytest.raises(CheckpointError, match="num_experts=4 and num_local_experts=8 disagree"):
        MoEModel.from_pretrained(ckpt)


def test_missing_moe_intermediate_size(tmp_path):
    ckpt = make_family_checkpoint(tmp_path, "qwen3_moe")
    edit_config(ckpt, moe_intermediate_size=None)
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        MoEModel.from_pretrained(ckpt)
