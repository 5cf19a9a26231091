"""Bad input gets a clear moeflow error naming the file, tensor or argument at fault."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from moeflow import CheckpointError, InputError, MoEOffloadedMixtral, UnsupportedQuantizationError
from moeflow.tools.quantize import quantize_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0)


def copy_ckpt(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        MoEOffloadedMixtral.from_pretrained(tmp_path / "nope")


def test_unknown_hub_id_offline():
    with pytest.raises(CheckpointError, match="no-such-org/no-such-model"):
        MoEOffloadedMixtral.from_pretrained("no-such-org/no-such-model")


def test_missing_config(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_missing_weights(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_missing_shard_listed_in_index(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_truncated_safetensors(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_git_lfs_pointer_instead_of_weights(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    (d / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_shape_disagrees_with_config(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 72
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*\(64, 64\).*\(72, 64\)"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_missing_expert_tensor(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        MoEOffloadedMixtral.from_pretrained(d)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}, "desc_act=true"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False}, "GPTQ with bits=8"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "FP8 format 'e5m2' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"}, "group_size=16"),
])
def test_unsupported_quantization(ckpt, tmp_path, qc, match):
    d = copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match=match):
        MoEOffloadedMixtral.from_pretrained(d)


def test_not_a_mixtral(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="llama"):
        MoEOffloadedMixtral.from_pretrained(d)


def test_bad_arguments(ckpt):
    with pytest.raises(ValueError, match="kernels"):
        MoEOffloadedMixtral.from_pretrained(ckpt, kernels="cuda")
    with pytest.raises(ValueError, match="dtype"):
        MoEOffloadedMixtral.from_pretrained(ckpt, dtype=torch.int8)


def test_bad_inputs(ckpt):
    model = MoEOffloadedMixtral.from_pretrained(ckpt)
    with pytest.raises(InputError, match="token id 97"):
        model(torch.tensor([[1, 2, 97]]))
    with pytest.raises(InputError, match="token id -1"):
        model.generate(torch.tensor([[1, -1]]))
    with pytest.raises(InputError, match="max_position_embeddings=256"):
        model(torch.zeros((1, 257), dtype=torch.long))
    with pytest.raises(InputError, match="max_new_tokens"):
        model.generate(torch.zeros((1, 250), dtype=torch.long), max_new_tokens=10)
    with pytest.raises(InputError, match="empty"):
        model.generate(torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(InputError, match="attention_mask"):
        model(torch.zeros((1, 4), dtype=torch.long), attention_mask=torch.ones((1, 5)))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros((1, 4), dtype=torch.long), do_sample=True, temperature=0.0)


def test_quantize_refuses_existing_output_and_quantized_input(ckpt, tmp_path):
    out = quantize_checkpoint(ckpt, tmp_path / "q", group_size=32, progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        quantize_checkpoint(ckpt, out, group_size=32, progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "q2", group_size=32, progress=False)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_checkpoint(ckpt, tmp_path / "q3", group_size=48, progress=False)
