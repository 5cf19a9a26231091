"""DeepSeek-V3.2 as published (FP8 block-scaled, the indexer's wq_b / wk included) and DeepSeek-V3.2 / GLM-5 in AWQ
4-bit (``moeflow quantize``): logits and greedy tokens against transformers carrying the same effective weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_family_dsa import assert_matches, prompt
from test_fp8 import BLOCK, reference_on
from tiny_dsa import DEEPSEEK_V32, GLM_MOE_DSA, make_dsa_checkpoint
from tiny_families import dequantized_reference

from moeflow import MoEModel
from moeflow.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from moeflow.tools.quantize import quantize_checkpoint

pytest.importorskip("transformers")
GROUP = 32


def fp8_target(name: str, t: torch.Tensor) -> bool:
    """What the published DeepSeek-V3.2 stores in FP8: the decoder layers' 2-D linear weights but the router and
    the indexer's per-head weights (``weights_proj``, kept in 16/32 bits)."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2 \
        and not name.endswith(("mlp.gate.weight", "weights_proj.weight"))


def test_fp8_checkpoint_matches_transformers(tmp_path):
    _, ref = make_dsa_checkpoint(tmp_path / "src", "deepseek_v32", seed=4, **DEEPSEEK_V32["groups-dense"])
    out, effective = {}, {}
    for name, t in load_file(tmp_path / "src" / "model.safetensors").items():
        if fp8_target(name, t):
            q, scale_inv = quantize_fp8_block(t, BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale_inv
            effective[name] = dequantize_fp8_block(q, scale_inv, BLOCK)
        else:
            out[name] = effective[name] = t
    assert "model.layers.1.self_attn.indexer.wq_b.weight_scale_inv" in out
    (tmp_path / "fp8").mkdir()
    save_file(out, tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    model = MoEModel.from_pretrained(tmp_path / "fp8", dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    ids = prompt(ref.config.vocab_size)
    assert_matches(model, reference_on(ref, effective, GROUP), ids, torch.ones_like(ids))


# seeds whose indexer scores hold no exact tie at the top-k boundary (a query with fewer than index_topk keys of
# positive score ties its zeros, which transformers' own prefill and decode then break differently)
@pytest.mark.parametrize("kind,name,seed", [("deepseek_v32", "yarn-topk4-unnormalised", 2),
                                            ("glm_moe_dsa", "shared-indexers-dense", 4)])
def test_awq_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, kind, name, seed):
    configs = {"deepseek_v32": DEEPSEEK_V32, "glm_moe_dsa": GLM_MOE_DSA}[kind]
    src, ref = make_dsa_checkpoint(tmp_path / "src", kind, seed=seed, **configs[name])
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=GROUP, progress=False)
    names = load_file(dst / "model.safetensors").keys()
    assert "model.layers.0.self_attn.indexer.wk.weight" in names  # the indexer stays dense
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    ids = prompt(ref.config.vocab_size)
    assert_matches(model, dequantized_reference(ref, dst, GROUP), ids, torch.ones_like(ids))


def test_weights_proj_stays_fp32_in_a_bf16_model(tmp_path):
    make_dsa_checkpoint(tmp_path, "glm_moe_dsa", **GLM_MOE_DSA["all-full-groups"])
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32 and indexer.wk.weight.dtype == torch.bfloat16
    assert model.generate(prompt(97, rows=1), max_new_tokens=4, eos_token_id=[]).shape == (1, 24)
