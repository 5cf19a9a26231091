"""Multi-head latent attention: the latent KV cache (size, same tokens as full heads), absorbed = expanded
attention, YaRN frequencies as transformers computes them."""

from __future__ import annotations

import pytest
import torch
from tiny_families import DEEPSEEK_V2, DEEPSEEK_V3, make_checkpoint

from moeflow import MoEModel
from moeflow.engine.latent_cache import LatentKVCache, new_kv_cache
from moeflow.families.base import KVCacheSpec
from moeflow.families.mla import LatentAttention, MLAShape, rotary_from_config

transformers = pytest.importorskip("transformers")


def test_latent_cache_size_and_use(tmp_path):
    make_checkpoint(tmp_path, "deepseek_v3", **DEEPSEEK_V3["qlora-groups-dense"])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float16)
    cfg = model.config
    made = []
    runner_new_cache = model._runner.new_cache
    model._runner.new_cache = lambda b, n: made.append(runner_new_cache(b, n)) or made[-1]
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
    cache = made[0]
    assert isinstance(cache, LatentKVCache)
    tokens = 3 * (7 + 5)
    per_token_layer = cache.nbytes / (tokens * cfg.num_hidden_layers)
    assert per_token_layer <= (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    heads = KVCacheSpec(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    full = new_kv_cache(heads, 3, 12, torch.float16, "cpu")
    assert cache.nbytes * 4 < full.nbytes  # 40 values per token per layer instead of 2 x 4 heads x 24


def test_a_kept_cache_follows_the_family_cache_kind(tmp_path):
    """With the cache kept between generates (CUDA graphs), switching latent_kv_cache off gets full heads, not the
    kept latent cache of the same length."""
    make_checkpoint(tmp_path, "deepseek_v3", **DEEPSEEK_V3["qlora-groups-dense"])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float16)
    runner = model.runner
    runner.reuse_cache = True
    latent = runner.new_cache(2, 10)
    assert isinstance(latent, LatentKVCache) and runner.new_cache(2, 30) is latent
    model.family.latent_kv_cache = False
    assert not isinstance(runner.new_cache(2, 10), LatentKVCache)


@pytest.mark.parametrize("kind,name", [("deepseek_v3", "qlora-groups-dense"), ("deepseek_v3", "yarn-halves-rope"),
                                       ("deepseek_v2", "greedy-no-qlora")])
def test_latent_cache_gives_the_full_head_tokens(tmp_path, kind, name):
    make_checkpoint(tmp_path, kind, seed=2, **(DEEPSEEK_V3 if kind == "deepseek_v3" else DEEPSEEK_V2)[name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    latent = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[])
    micro = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[],
                           micro_batch_size=2)
    model.family.latent_kv_cache = False
    full = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[])
    assert torch.equal(latent, full)
    assert torch.equal(micro, full)


def test_absorbed_attention_equals_expanded():
    torch.manual_seed(0)
    shape = MLAShape(hidden_size=32, num_heads=3, q_lora_rank=None, kv_lora_rank=10, qk_nope_head_dim=6,
                     qk_rope_head_dim=4, v_head_dim=5)
    attn = LatentAttention(shape, 0, lambda _n, i, o: torch.nn.Linear(i, o, bias=False), torch.float64)
    torch.nn.init.normal_(attn.kv_b_proj.weight)
    b, t, s = 2, 3, 7  # queries at positions 4..6 of 7 cached tokens
    q_nope, q_rope = torch.randn(b, 3, t, 6, dtype=torch.float64), torch.randn(b, 3, t, 4, dtype=torch.float64)
    latents = torch.randn(b, s, 14, dtype=torch.float64)
    mask = (torch.arange(s)[None, :] <= torch.arange(4, 7)[:, None])[None, None].expand(b, 1, t, s)
    absorbed = attn.absorbed(q_nope, q_rope, latents, mask)
    k, v = attn.expand(latents[..., :10], latents[..., 10:])
    expanded = attn.attend(q_nope, q_rope, k, v, mask)
    assert torch.allclose(absorbed, expanded, atol=1e-10)


def test_yarn_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    cfg = transformers.DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163840)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rotary, softmax_mult = rotary_from_config(rope, cfg.qk_rope_head_dim, 10000.0, 163840, "config.json")
    assert torch.allclose(rotary.inv_freq, want_freq, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(want_factor)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = DeepseekV3Attention(cfg, 0)
    assert (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * softmax_mult == pytest.approx(hf.scaling)
    assert softmax_mult > 1.5  # mscale(40) ** 2: YaRN really sharpens the softmax here


def test_selection_bias_stays_fp32_in_a_half_precision_model(tmp_path):
    make_checkpoint(tmp_path, "deepseek_v3", **DEEPSEEK_V3["qlora-groups-dense"])
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    block = model.model.moe_blocks[0]
    assert block.gate.weight.dtype == torch.bfloat16
    assert block.gate.e_score_correction_bias.dtype == torch.float32
