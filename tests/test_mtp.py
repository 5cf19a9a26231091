"""DeepSeek-V3's multi-token-prediction layer as read by moeflow: shapes and checkpoint names against the published
config, the layer's logits against an fp32 reference built on transformers' decoder layer, loading with and without
the MTP tensors, and the refusals naming the config field / tensor / argument. ~10 s on 2 cores."""

from __future__ import annotations

import json

import pytest
import torch
from mtp_helpers import make_mtp_checkpoint, mtp_layer_logits, reference_mtp_logits
from torch import nn

from moeflow import MoEModel
from moeflow.engine.generate import positions_from_mask
from moeflow.engine.mtp import MTPDrafter, eager_pass
from moeflow.errors import CheckpointError
from moeflow.families import family_for_config
from moeflow.families.layers import RMSNorm
from moeflow.families.mla import LatentAttention
from moeflow.moe.block import MoEBlock

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=6, n_group=3, topk_group=2,
             num_experts_per_tok=2, q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5)

# the fields of deepseek-ai/DeepSeek-V3's published config.json that shape the model
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


# the fields of zai-org/GLM-4.5's published config.json that shape the model
GLM_45 = {
    "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True,
    "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1000000, "tie_word_embeddings": False,
}
GLM_SHAPE = dict(num_hidden_layers=3, n_routed_experts=6, num_key_value_heads=2, head_dim=32, use_qk_norm=True,
                 attention_bias=True, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5, partial_rotary_factor=0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), seed=5, **dict(SHAPE))


def test_published_deepseek_v3_mtp_shapes_and_names():
    family = family_for_config(DEEPSEEK_V3)
    assert family.num_mtp_layers() == 1 and family.mtp_config_field == "num_nextn_predict_layers"
    with torch.device("meta"):
        mtp = family.build_mtp(torch.bfloat16, lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias))
    params = dict(mtp.named_parameters()) | dict(mtp.named_buffers())
    names = {family.mtp_checkpoint_name(p, None): tuple(t.shape) for p, t in params.items()}
    assert names["model.layers.61.enorm.weight"] == (7168,)
    assert names["model.layers.61.hnorm.weight"] == (7168,)
    assert names["model.layers.61.eh_proj.weight"] == (7168, 2 * 7168)
    assert names["model.layers.61.shared_head.norm.weight"] == (7168,)
    assert names["model.layers.61.input_layernorm.weight"] == (7168,)
    assert names["model.layers.61.self_attn.q_a_proj.weight"] == (1536, 7168)
    assert names["model.layers.61.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert names["model.layers.61.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert names["model.layers.61.self_attn.kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert names["model.layers.61.mlp.gate.weight"] == (256, 7168)
    assert names["model.layers.61.mlp.gate.e_score_correction_bias"] == (256,)
    assert names["model.layers.61.mlp.shared_experts.down_proj.weight"] == (7168, 2048)
    # the shared embedding and head are the main model's: never read from the MTP layer
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in names)
    (block,) = mtp.moe_blocks
    assert block.layer_idx == 58 == len(family.moe_layers)  # the backend's MoE layer after the decoder's 58
    assert family.expert_base(58) == "model.layers.61.mlp.experts"
    assert family.expert_base(57) == "model.layers.60.mlp.experts"
    layer = mtp.layers[0]
    assert isinstance(layer.block.self_attn, LatentAttention) and layer.block.self_attn.layer_idx == 0
    assert isinstance(layer.enorm, RMSNorm)


def test_published_glm_45_mtp_shapes_and_names():
    family = family_for_config(GLM_45)
    assert family.num_mtp_layers() == 1
    with torch.device("meta"):
        mtp = family.build_mtp(torch.bfloat16, lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias))
    names = {family.mtp_checkpoint_name(p, None): tuple(t.shape) for p, t in mtp.named_parameters()}
    assert names["model.layers.92.eh_proj.weight"] == (5120, 2 * 5120)
    assert names["model.layers.92.shared_head.norm.weight"] == (5120,)
    assert names["model.layers.92.self_attn.q_proj.weight"] == (96 * 128, 5120)
    assert names["model.layers.92.self_attn.k_proj.bias"] == (8 * 128,)
    assert names["model.layers.92.self_attn.q_norm.weight"] == (128,)
    assert names["model.layers.92.mlp.gate.weight"] == (160, 5120)
    assert names["model.layers.92.mlp.shared_experts.up_proj.weight"] == (1536, 5120)
    assert mtp.moe_blocks[0].layer_idx == 89 and family.expert_base(89) == "model.layers.92.mlp.experts"


def test_families_without_mtp_name_the_field():
    family = family_for_config({**DEEPSEEK_V3, "num_nextn_predict_layers": 0})
    assert family.num_mtp_layers() == 0
    v32 = family_for_config({**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64,
                             "index_topk": 2048})
    with pytest.raises(NotImplementedError, match="indexer"):
        v32.build_mtp(torch.float32, None)


def test_mtp_layer_matches_the_fp32_reference(tiny):
    path, ref, own = tiny
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    want = reference_mtp_logits(ref, own, ids)  # [7, V]: positions 0..6
    got = mtp_layer_logits(model, ids)[1][0]
    assert got.shape == want.shape == (ids.shape[1] - 1, 97)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_glm_mtp_layer_matches_the_fp32_reference(tmp_path):
    path, ref, own = make_mtp_checkpoint(tmp_path, seed=3, kind="glm4_moe", **dict(GLM_SHAPE))
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    want = reference_mtp_logits(ref, own, ids)[-1]
    runner, mask = model.runner, torch.ones_like(ids, dtype=torch.bool)
    pos = positions_from_mask(mask)
    with torch.inference_mode():
        _, hidden = eager_pass(runner, ids, pos, runner.new_cache(1, 16, reuse=False), torch.arange(9), mask,
                               "prefill", (ids, mask), True)
        got, _ = MTPDrafter(runner, model.mtp, 16).run(0, hidden[:, :-1], ids[:, 1:], pos[:, :-1], torch.arange(8),
                                                       mask[:, :-1], (ids, mask))
    assert float((got[0] - want).abs().max() / want.abs().max()) < 1e-5


def test_loads_with_and_without_mtp(tiny, tmp_path):
    path, _, _ = tiny
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = MoEModel.from_pretrained(path)
    assert plain.mtp is None
    with_mtp = MoEModel.from_pretrained(path, mtp=True)
    assert isinstance(with_mtp.mtp.moe_blocks[0], MoEBlock)
    # the MTP layer's experts are loaded into the backend as its last MoE layer
    assert len(with_mtp.experts.slot_tables) == 3 == len(plain.experts.slot_tables) + 1
    # the memory plan counts the MTP layer's experts and its other weights
    mine, theirs = with_mtp.memory_plan(), plain.memory_plan()
    assert mine.total_experts == theirs.total_experts + 6 and mine.non_expert > theirs.non_expert
    out = plain.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
    assert torch.equal(with_mtp.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[]), out)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=1.*mtp=True"):
        plain.generate(ids, max_new_tokens=4, do_sample=False, num_speculative_tokens=2)
    # a checkpoint without the MTP tensors (what transformers saves) loads without them, refuses mtp=True
    bare, _, _ = make_mtp_checkpoint(tmp_path / "bare", seed=5, with_mtp=False, **dict(SHAPE))
    assert torch.equal(MoEModel.from_pretrained(bare).generate(ids, max_new_tokens=6, do_sample=False,
                                                               eos_token_id=[]), out)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\..*missing.*num_nextn_predict_layers=1"):
        MoEModel.from_pretrained(bare, mtp=True)
    # a config without MTP layers: refused at load and at generate, naming the field
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=0"):
        MoEModel.from_pretrained(bare, mtp=True)
    none = MoEModel.from_pretrained(bare)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0.*prompt_lookup_num_tokens"):
        none.generate(ids, max_new_tokens=4, do_sample=False, num_speculative_tokens=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_speculative_tokens=0), "positive integer"),
    (dict(num_speculative_tokens=2, micro_batch_size=1), "micro_batch_size"),
    (dict(num_speculative_tokens=2, prompt_lookup_num_tokens=2), "pass one"),
])
def test_refusals_name_the_argument(tiny, kwargs, match):
    model = MoEModel.from_pretrained(tiny[0], mtp=True)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=match):
        model.generate(ids, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="batch of one"):
        model.generate(ids.repeat(2, 1), max_new_tokens=4, do_sample=False, num_speculative_tokens=1)
