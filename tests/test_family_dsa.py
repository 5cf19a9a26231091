"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) through ``moeflow.MoEModel`` against transformers on
tiny random checkpoints (fp32) whose ``index_topk`` (4-6) is far below the prompts' lengths, so the sparse
selection decides the logits."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_dsa import DEEPSEEK_V32, GLM_MOE_DSA, make_dsa_checkpoint

from moeflow import MoEModel
from moeflow.errors import CheckpointError, InputError

pytest.importorskip("transformers")
CONFIGS = {"deepseek_v32": DEEPSEEK_V32, "glm_moe_dsa": GLM_MOE_DSA}
CASES = [(kind, name) for kind, configs in CONFIGS.items() for name in configs]
PROMPT = 20  # tokens: > 3 x index_topk


def prompt(vocab: int, seed: int = 3, rows: int = 2, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_matches(model, ref, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int = 32) -> None:
    """Logits of the real positions within 1e-4 (relative to the largest) and ``new_tokens`` greedy tokens equal."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() uses on both sides for a left-padded batch
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, position_ids=positions).logits
        want_tokens = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((got - want)[real].abs().max() / want[real].abs().max()) < 1e-4
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=[]), want_tokens)


@pytest.mark.parametrize("kind,name", CASES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind, name):
    _, ref = make_dsa_checkpoint(tmp_path, kind, seed=1, **CONFIGS[kind][name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == kind
    ids = prompt(ref.config.vocab_size)
    assert_matches(model, ref, ids, torch.ones_like(ids))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the indexer must never pick a padding key
    assert_matches(model, ref, ids, mask, new_tokens=16)


def test_glm5_shared_layers_read_the_previous_selection(tmp_path):
    _, ref = make_dsa_checkpoint(tmp_path, "glm_moe_dsa", seed=1, **GLM_MOE_DSA["shared-indexers-dense"])
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.indexer is not None for a in attn] == [True, False, True, False]
    assert [ref.model.layers[i].self_attn.indexer is not None for i in range(4)] == [True, False, True, False]


def test_prefill_scores_in_query_chunks_select_the_same_keys(tmp_path, monkeypatch):
    """A long prompt's [queries, heads, keys] index scores are computed a chunk of queries at a time."""
    from moeflow.families import dsa

    make_dsa_checkpoint(tmp_path, "deepseek_v32", seed=1, **DEEPSEEK_V32["groups-dense"])
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32)
    ids = prompt(97)
    whole = model(ids).logits
    monkeypatch.setattr(dsa, "INDEX_SCORE_BYTES", 2 * 8 * 4 * 20 * 3)  # 3 queries per chunk (batch 2, 8 heads)
    assert torch.allclose(model(ids).logits, whole, rtol=0, atol=1e-6)


def sparse_and_dense(tmp_path, kind: str, name: str, index_topk: int | None = None):
    """(logits of the DSA checkpoint, logits of the same weights read as DeepSeek-V3: dense MLA, no indexer)."""
    make_dsa_checkpoint(tmp_path / "dsa", kind, seed=1, **CONFIGS[kind][name])
    config = json.loads((tmp_path / "dsa" / "config.json").read_text())
    if index_topk is not None:
        config["index_topk"] = index_topk
        (tmp_path / "dsa" / "config.json").write_text(json.dumps(config))
    ids = prompt(config["vocab_size"], length=24)
    sparse = MoEModel.from_pretrained(tmp_path / "dsa", dtype=torch.float32)(ids).logits
    (tmp_path / "dsa" / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    dense = MoEModel.from_pretrained(tmp_path / "dsa", dtype=torch.float32)
    assert dense.family.name == "deepseek_v3"
    return sparse, dense(ids).logits


@pytest.mark.parametrize("kind,name", [("deepseek_v32", "groups-dense"), ("glm_moe_dsa", "shared-indexers-dense")])
def test_sparse_attention_differs_from_dense_mla_past_index_topk(tmp_path, kind, name):
    sparse, dense = sparse_and_dense(tmp_path, kind, name)
    topk = CONFIGS[kind][name].get("index_topk", 6)
    # positions < index_topk see every key: equal; later ones see only the selected keys: different
    assert torch.allclose(sparse[:, :topk], dense[:, :topk], rtol=1e-4, atol=1e-4)
    assert float((sparse[:, topk:] - dense[:, topk:]).abs().max() / dense.abs().max()) > 0.05


def test_sparse_attention_equals_dense_mla_when_every_key_is_selected(tmp_path):
    sparse, dense = sparse_and_dense(tmp_path, "glm_moe_dsa", "all-full-groups", index_topk=64)
    assert float((sparse - dense).abs().max() / dense.abs().max()) < 1e-5


def test_published_config_fields(tmp_path):
    """Fields as the hub's config.json has them (rope_scaling, indexer_rope_interleave, index_topk_freq) and as
    transformers 5.x writes them (rope_parameters, mlp_layer_types, layer_types: either version's name,
    indexer_types)."""
    from moeflow.families import family_for_config

    make_dsa_checkpoint(tmp_path, "glm_moe_dsa", **GLM_MOE_DSA["shared-indexers-dense"])
    written = json.loads((tmp_path / "config.json").read_text())
    family = family_for_config(written)
    assert family.config.indexer_types == ["full", "shared", "full", "shared"] and family.indexer_interleaved
    assert family.moe_layers == (1, 2, 3) and family.config.index_topk == 6
    for kind in ("indexed_attention", "deepseek_sparse_attention"):  # transformers 5.24's name, 5.17's
        assert family_for_config({**written, "layer_types": [kind] * 4}).config.indexer_types == \
            family.config.indexer_types
    hub = {k: v for k, v in written.items() if k not in ("indexer_types", "mlp_layer_types", "layer_types",
                                                         "rope_parameters")}
    hub.update(num_hidden_layers=8, first_k_dense_replace=3, index_topk_freq=4, index_skip_topk_offset=2,
               indexer_rope_interleave=True, rope_theta=1000000.0, rope_scaling=None)
    family = family_for_config(hub)
    assert family.config.indexer_types == ["full", "full", "shared", "shared", "shared", "full", "shared", "shared"]
    assert family.moe_layers == (3, 4, 5, 6, 7) and family.config.rope_theta == 1000000.0
    assert family_for_config({**hub, "index_topk_pattern": "FSFFSSSF"}).config.indexer_types[:4] == \
        ["full", "shared", "full", "full"]
    v32 = family_for_config({**hub, "model_type": "deepseek_v32", "indexer_rope_interleave": None})
    assert v32.config.indexer_types == ["full"] * 8 and not v32.indexer_interleaved  # V3.2 never shares
    assert family.kv_cache_spec().latent_dim == 16 + 8 + 16  # kv_lora_rank + qk_rope_head_dim + index_head_dim


@pytest.mark.parametrize(("kind", "change", "match"), [
    ("deepseek_v32", {"q_lora_rank": None}, "deepseek_v32 needs q_lora_rank"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]}, "the first 'full'"),
    ("glm_moe_dsa", {"indexer_types": ["full", "full"]}, r"indexer_types=\['full', 'full'\] must give"),
    ("deepseek_v32", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     r"layer_types \['full_attention'\] are not supported for deepseek_v32"),
    ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim=4 is smaller than the rotary part"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk=0"),
    ("glm_moe_dsa", {"kv_lora_rank": None}, "missing required field.*kv_lora_rank"),
])
def test_unsupported_configs_are_named(tmp_path, kind, change, match):
    make_dsa_checkpoint(tmp_path, kind, **next(iter(CONFIGS[kind].values())))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)


def test_a_full_head_cache_is_refused_by_name(tmp_path):
    from moeflow.engine.kv_cache import StaticKVCache

    make_dsa_checkpoint(tmp_path, "deepseek_v32", **DEEPSEEK_V32["groups-dense"])
    model = MoEModel.from_pretrained(tmp_path)
    model.family.latent_kv_cache = False
    with pytest.raises(InputError, match="deepseek_v32: latent_kv_cache=False is not supported"):
        model.generate(prompt(97, rows=1), max_new_tokens=2)
    cfg, ids = model.config, prompt(97, rows=1)
    cache = StaticKVCache(cfg.num_hidden_layers, 1, 32, cfg.num_attention_heads, 24, torch.float32, "cpu")
    with pytest.raises(InputError, match="StaticKVCache \\(a full-head cache.*\\) has none"):  # the layer's own check
        model.model(model.model.embed_tokens(ids), torch.arange(20)[None], cache, torch.arange(20),
                    torch.ones_like(ids, dtype=torch.bool), model.experts)
