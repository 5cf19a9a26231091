"""compressed-tensors W4A16 checkpoints written by compressed-tensors' own compressor (Mixtral, Qwen3-MoE, Qwen2-MoE
with its shared expert; symmetric and asymmetric; group 32, 64 and 128; modules left 16-bit by ``ignore``):
moeflow's logits and 32 greedy tokens against transformers on the weights compressed-tensors' own dequantizer
gives; the exact-token invariant when offloading; the disk tier reading its experts; refusals by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from ctensors_helpers import ROUTERS, transformers_reference, write_ct_checkpoint
from family_models import make_family_checkpoint
from helpers import host_budget_rows_gb, make_tiny_checkpoint
from safetensors.torch import load_file
from test_families_quant import check

from moeflow import MoEModel, OffloadConfig, UnsupportedQuantizationError
from moeflow.engine.build import open_expert_index
from moeflow.families import family_for_config
from moeflow.families.layers import AWQLinear
from moeflow.io.checkpoint import open_checkpoint, read_json, read_quantization
from moeflow.offload import DiskHostStore
from moeflow.offload.predictors import train_predictor
from moeflow.tools.record import record_trace

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

QWEN3 = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, intermediate_size=64)
QWEN3_128 = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, num_attention_heads=4)
QWEN2 = dict(shared_expert_intermediate_size=64, intermediate_size=64)
QWEN2_64 = dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64, intermediate_size=64)
# name: (model type, config overrides, group, symmetric, ignore (None: lm_head and the routers))
CASES = {
    "mixtral-g32-sym-lm-head-4bit": ("mixtral", {}, 32, True, ROUTERS),
    "mixtral-g128-asym": ("mixtral", dict(hidden_size=128, intermediate_size=128), 128, False, None),
    "qwen3-g32-asym-dense-layer": ("qwen3_moe", QWEN3, 32, False, None),
    "qwen3-g128-sym-attention-16bit": ("qwen3_moe", QWEN3_128, 128, True, ["lm_head", *ROUTERS, "re:.*self_attn.*"]),
    "qwen2-shared-g32-sym": ("qwen2_moe", QWEN2, 32, True, None),
    "qwen2-shared-16bit-g64-asym": ("qwen2_moe", QWEN2_64, 64, False, ["lm_head", *ROUTERS, "re:.*shared_expert\\..*"]),
}


def source(root, model_type: str, overrides: dict):
    if model_type == "mixtral":
        return make_tiny_checkpoint(root / "fp32", seed=0, **overrides)
    return make_family_checkpoint(root / "fp32", model_type, seed=0, **overrides)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_on_compressed_tensors_decompression(tmp_path, name):
    model_type, overrides, group, symmetric, ignore = CASES[name]
    path = write_ct_checkpoint(source(tmp_path, model_type, overrides), tmp_path / "ct", group, symmetric, ignore)
    qc = read_json(path / "config.json")["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    stored = load_file(path / "model.safetensors").keys()
    assert ("lm_head.weight_packed" in stored) == (ignore is not None and "lm_head" not in ignore)  # kept 16-bit
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq" and model.experts.fmt.group_size == group
    attention = model.model.layers[0].self_attn.q_proj
    assert isinstance(attention, AWQLinear) == ("re:.*self_attn.*" not in (ignore or ()))
    if model_type == "qwen2_moe":  # an ignored shared expert stays 16-bit beside 4-bit attention
        shared = model.model.layers[0].mlp.shared_expert.up_proj
        assert isinstance(shared, AWQLinear) == (ignore is None)
    check(model, transformers_reference(path, tmp_path / "reference"), new_tokens=32)


NEW_TOKENS = 6


@pytest.fixture(scope="module")
def qwen3_ct(tmp_path_factory):
    """Qwen3-MoE, 2 MoE layers x 8 experts, asymmetric group 32, with its resident greedy tokens."""
    root = tmp_path_factory.mktemp("qwen3_ct")
    path = write_ct_checkpoint(source(root, "qwen3_moe", QWEN3), root / "ct", 32, False)
    resident = MoEModel.from_pretrained(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6)]
    trace = record_trace(resident, prompts, max_new_tokens=4, hidden=True)
    train_predictor("promoe", trace, eval_fraction=0.25, epochs=1).save(path / "predictors" / "promoe.pt")
    ids = torch.randint(0, 97, (2, 7), generator=gen)
    expected = resident.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    return path, ids, expected


def _generate(path, ids, **config):
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(**config))
    try:
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[]), model
    finally:
        model.close()


@pytest.mark.parametrize("policy", ["lru", "mixtral-offloading", "promoe"])
def test_offloading_keeps_the_resident_tokens(qwen3_ct, policy):
    path, ids, expected = qwen3_ct
    for slots in (2, 5, 16):
        out, model = _generate(path, ids, policy=policy, gpu_expert_slots=slots, transport="random-delay",
                               random_delay_ms=0.2, seed=slots)
        assert torch.equal(out, expected), f"{policy} with {slots} slots"
        if slots < 16:
            assert model.stats.prefill.misses + model.stats.decode.misses > 0


def test_disk_tier_reads_the_experts(qwen3_ct, calibration_cache):
    """A quarter of the experts in host memory, the rest read from the checkpoint through the expert index (its
    raw weight_packed / weight_scale / weight_zero_point byte ranges, repacked as read): the resident tokens."""
    path, ids, expected = qwen3_ct
    raw = read_json(path / "config.json")
    family, quant = family_for_config(raw, "config.json"), read_quantization(path, raw)
    reader = open_checkpoint(path, quant)
    index = open_expert_index(reader, family, family.detect_expert_layout(reader), quant)
    assert all(".weight_" in p.name for e in index.experts.values() for p in e.pieces)  # the stored tensors
    index.close()
    budget = host_budget_rows_gb(path, 4, readers=2)
    for policy in ("lru", "mixtral-offloading"):
        out, model = _generate(path, ids, policy=policy, gpu_expert_slots=3, host_memory_gb=budget,
                               disk_readers=2)
        assert torch.equal(out, expected), policy
        host = model.experts.host
        assert isinstance(host, DiskHostStore) and host.on_disk and host.capacity == 4
        assert host.stats.bytes_read > host.stats.load_bytes_read and host.stats.misses > 0


def test_refusals_name_config_json_and_the_field(tmp_path):
    path = write_ct_checkpoint(source(tmp_path, "qwen3_moe", {}), tmp_path / "ct", 32, True)
    config = json.loads((path / "config.json").read_text())
    for change, match in ((dict(num_bits=8), "num_bits=8"), (dict(strategy="channel"), "strategy='channel'"),
                          (dict(actorder="group"), "actorder='group'")):
        changed = json.loads(json.dumps(config))
        changed["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
        (path / "config.json").write_text(json.dumps(changed))
        where = re.escape(str(path / "config.json"))
        with pytest.raises(UnsupportedQuantizationError,
                           match=rf"{where}: quantization_config\.config_groups\.group_0\.weights\.{match}"):
            MoEModel.from_pretrained(path)
