"""Hunyuan-A13B through ``moeflow.MoEModel`` against transformers' ``HunYuanMoEV1ForCausalLM`` on tiny random
checkpoints (fp32 logits within 1e-4, 32 greedy tokens): configs as transformers 5.x writes them and as published,
the exact-token invariant for every offload policy, and the config.json options refused by name. AWQ and Fiddler are
in ``test_family_awq.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_families import (
    HUNYUAN,
    assert_keeps_resident_tokens,
    assert_matches_transformers,
    dequantized_reference,
    make_checkpoint,
    resident_reference,
)

from moeflow import MoEModel
from moeflow.errors import CheckpointError
from moeflow.offload.policies import POLICY_NAMES
from moeflow.tools.quantize import quantize_checkpoint

pytest.importorskip("transformers")
CONFIG = HUNYUAN["alpha-rope-lists-tied"]
# the hub's config.json fields transformers 5.x does not write (tencent/Hunyuan-A13B-Instruct)
PUBLISHED = {"use_cla": False, "cla_share_factor": 2, "use_mla": False, "use_mixed_mlp_moe": True, "use_qk_norm": True,
             "use_rotary_pos_emb": True, "moe_layer_num_skipped": 0, "mlp_bias": False, "attention_head_dim": 32,
             "moe_drop_tokens": False, "moe_random_routing_dropped_token": False, "group_limited_greedy": False,
             "routed_scaling_factor": 1.0, "topk_method": "greedy", "capacity_factor": 1.0, "kv_lora_rank": None}


@pytest.mark.parametrize("name", list(HUNYUAN))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    _, ref = make_checkpoint(tmp_path, "hunyuan_v1_moe", seed=1, **HUNYUAN[name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == "hunyuan_v1_moe" and model.family.moe_layers == (0, 1, 2)
    assert_matches_transformers(model, ref)


def test_published_config_shape_matches_transformers(tmp_path):
    """``rope_scaling`` and a top-level ``rope_theta`` (no ``rope_parameters``), and the fields only Tencent's code
    reads: the NTK-alpha base is ``rope_theta x alpha^(d / (d - 2))``."""
    _, ref = make_checkpoint(tmp_path, "hunyuan_v1_moe", seed=2, **CONFIG)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(PUBLISHED, rope_theta=rope.pop("rope_theta"), rope_scaling={
        k: v for k, v in rope.items() if k != "rope_type"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.config.rope_theta == pytest.approx(10000.0 * 1000.0 ** (32 / 30))
    assert_matches_transformers(model, ref)


@pytest.mark.parametrize(("change", "match"), [
    ({"use_cla": True}, "use_cla=True.*cross-layer"),
    ({"moe_topk": [2, 3, 2]}, r"moe_topk=\[2, 3, 2\] is not one value"),
    ({"num_shared_expert": [2, 2, 2]}, "num_shared_expert=2"),
    ({"moe_intermediate_size": [64] * 3}, "moe_intermediate_size=64"),
    ({"num_experts": [8, 8, 8]}, "num_experts=.*per-layer expert counts"),
    ({"moe_layer_num_skipped": 1}, "moe_layer_num_skipped=1"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'dynamic'"),
    ({"group_limited_greedy": True}, "group_limited_greedy=True"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, match):
    make_checkpoint(tmp_path, "hunyuan_v1_moe", **CONFIG)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)


def test_quantize_attention_takes_the_shared_mlp_too(tmp_path):
    """The shared MLP is built by the attention's linear factory: ``moeflow quantize --attention`` must quantize it
    under its own name (``mlp.shared_mlp``) for the checkpoint to load."""
    src, ref = make_checkpoint(tmp_path / "src", "hunyuan_v1_moe", seed=3, **CONFIG)
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    names = load_file(dst / "model.safetensors").keys()
    assert {"model.layers.0.mlp.shared_mlp.down_proj.qweight", "model.layers.0.self_attn.o_proj.qweight",
            "model.layers.0.mlp.gate.wg.weight"} <= names
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert_matches_transformers(model, dequantized_reference(ref, dst, 32))


MOE_LAYERS, EXPERTS, TOP_K, NEW_TOKENS = 2, 6, 2, 8
SHAPE = dict(CONFIG, num_hidden_layers=MOE_LAYERS, num_experts=EXPERTS, moe_topk=[TOP_K] * MOE_LAYERS,
             moe_intermediate_size=[32] * MOE_LAYERS, num_shared_expert=[1] * MOE_LAYERS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return resident_reference(tmp_path_factory.mktemp("hunyuan_invariant"), "hunyuan_v1_moe", seed=7, gen_seed=2,
                              padded_row=0, pad=3, new_tokens=NEW_TOKENS, **SHAPE)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p not in ("resident", "fiddler")])  # fiddler: AWQ
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    assert_keeps_resident_tokens(tiny, policy, transport, (TOP_K, MOE_LAYERS * EXPERTS // 2, MOE_LAYERS * EXPERTS - 1),
                                 NEW_TOKENS)
