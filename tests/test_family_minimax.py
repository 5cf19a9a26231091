"""MiniMax-M2 through ``moeflow.MoEModel`` against transformers' ``MiniMaxM2ForCausalLM`` on tiny random checkpoints
(fp32 logits within 1e-4, 32 greedy tokens): configs as transformers 5.x writes them and as published on the hub,
the published FP8 format on the weights it stands for, and the config.json options refused by name. AWQ and Fiddler
are in ``test_family_awq.py``, the exact-token invariant in ``test_invariant_minimax.py``."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_families import MINIMAX_M2, assert_matches_transformers, make_checkpoint, with_experts, write_fp8_checkpoint

from moeflow import MoEModel
from moeflow.errors import CheckpointError
from moeflow.kernels.cpu.native import native_available
from moeflow.quant.awq import dequantize
from moeflow.quant.fp8 import awq_expert_tensors
from moeflow.tools.quantize import quantize_checkpoint

pytest.importorskip("transformers")
CONFIG = MINIMAX_M2["qk-norm-partial-rotary"]
GROUP = 32
FP8_BLOCK = (16, 16)  # the release uses 128 x 128; 16 x 16 gives these tiny weights several blocks
# the hub's config.json fields transformers 5.x does not write (MiniMaxAI/MiniMax-M2, M2.1, M2.5)
PUBLISHED = {"attn_type_list": [1, 1, 1], "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
             "shared_intermediate_size": 0, "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1,
             "sliding_window": None}


def as_published(config: dict) -> dict:
    """transformers 5.x's config.json rewritten as the hub publishes it: ``rotary_dim`` and a top-level
    ``rope_theta`` instead of ``rope_parameters``, and the fields only MiniMax's own code reads."""
    theta = config["rope_parameters"]["rope_theta"]
    config = {k: v for k, v in config.items() if k != "rope_parameters"}
    return {**config, **PUBLISHED, "rope_theta": theta, "use_qk_norm": True, "use_routing_bias": True}


@pytest.mark.parametrize("name", list(MINIMAX_M2))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    _, ref = make_checkpoint(tmp_path, "minimax_m2", seed=1, **MINIMAX_M2[name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == "minimax_m2" and model.family.moe_layers == (0, 1, 2)
    assert model.family.config.rotary_dim == 16
    assert_matches_transformers(model, ref)


def test_published_config_shape_matches_transformers(tmp_path):
    _, ref = make_checkpoint(tmp_path, "minimax_m2", seed=2, **CONFIG)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(as_published(config)))
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.config.rotary_dim == 16 and model.family.config.rope_theta == 5e6
    assert_matches_transformers(model, ref)


@pytest.mark.parametrize(("change", "match"), [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size=64"),
    ({"attn_type_list": [0, 1, 1]}, r"attn_type_list=\[0, 1, 1\].*lightning"),
    ({"sliding_window": 128}, "sliding_window=128"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"use_grouped_topk": True, "num_expert_group": 2}, "use_grouped_topk=True"),
    ({"rotary_dim": 8}, "rotary_dim=8 disagrees with partial_rotary_factor=0.5"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, match):
    make_checkpoint(tmp_path, "minimax_m2", **CONFIG)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)


def awq_dequantized(awq: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's AWQ tensors (``w13_*``, ``w2_*``) -> (w13 [2I, H], w2 [H, I]) dequantized."""
    return tuple(dequantize(awq[f"{m}_qweight"], awq[f"{m}_qzeros"], awq[f"{m}_scales"].float(), GROUP).T
                 for m in ("w13", "w2"))


def test_published_fp8_checkpoint_loads_and_matches_transformers(tmp_path):
    """Every linear weight of the decoder layers but the router in FP8 with block scales, ``"fmt":
    "float8_e4m3fn"`` as MiniMax publishes it: dequantized at load, experts requantized to int4 (at load and by
    ``moeflow quantize``)."""
    src, ref = make_checkpoint(tmp_path / "src", "minimax_m2", seed=4, **CONFIG)
    config = as_published(json.loads((src / "config.json").read_text()))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK),
                                     "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    dst = tmp_path / "fp8"
    effective = write_fp8_checkpoint(src, dst, config, FP8_BLOCK, lambda name, t: name.startswith("model.layers.")
                                     and t.dim() == 2 and not name.endswith("block_sparse_moe.gate.weight"))
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq" and model.experts.fmt.group_size == GROUP
    experts = {}
    for layer in range(ref.config.num_hidden_layers):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        w = [awq_dequantized(awq_expert_tensors(
            torch.cat([effective[f"{base}.{e}.w1.weight"], effective[f"{base}.{e}.w3.weight"]]),
            effective[f"{base}.{e}.w2.weight"], GROUP)) for e in range(ref.config.num_local_experts)]
        experts[f"model.layers.{layer}"] = (torch.stack([x[0] for x in w]), torch.stack([x[1] for x in w]))
    state = {k: v for k, v in effective.items() if ".experts." not in k}
    assert_matches_transformers(model, with_experts(ref, state, experts))
    # ``moeflow quantize`` of the FP8 checkpoint: the same int4 experts, so the same tokens
    awq = quantize_checkpoint(dst, tmp_path / "awq", group_size=GROUP, progress=False)
    ids = torch.arange(5)[None] + 7
    tokens = [MoEModel.from_pretrained(p, kernels="torch").generate(ids, max_new_tokens=12, do_sample=False,
                                                                   eos_token_id=[]) for p in (dst, awq)]
    assert torch.equal(*tokens)


@pytest.mark.skipif(not native_available(), reason="moeflow's CPU library is not built")
@pytest.mark.parametrize(("rotary_dim", "fused", "qk_norm"), [(16, False, False), (32, True, False), (32, True, True)])
def test_cpu_int4_fuses_attention_only_over_whole_head_rotary(tmp_path, rotary_dim, fused, qk_norm):
    """The CPU int4 path may run attention as one native call (with its QK-norm over the projection, if any), which
    turns whole heads: a partial rotary layer keeps the torch step (and computes what the torch kernels compute), a
    whole-head one is fused."""
    config = dict(CONFIG, use_qk_norm=qk_norm, rotary_dim=rotary_dim)
    src, _ = make_checkpoint(tmp_path / "src", "minimax_m2", seed=5, **config)
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=GROUP, quantize_attention=True, progress=False)
    model = MoEModel.from_pretrained(dst, dtype=torch.float32)
    assert model.kernels == "cpu-int4"
    assert [layer.self_attn.fused_step for layer in model.model.layers] == [fused] * 3
    ids = torch.arange(7)[None] + 3
    want = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")(ids).logits
    assert float((model(ids).logits - want).norm() / want.norm()) < 0.1  # int8-rounded activations on the CPU path
