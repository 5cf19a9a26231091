"""Qwen3-MoE, Qwen2-MoE and OLMoE against transformers' own classes on tiny random checkpoints (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import make_family_checkpoint, make_family_model
from test_model import rel_err

from moeflow import MoEModel
from moeflow.families import OlmoeFamily, Qwen2MoeFamily, Qwen3MoeFamily

CONFIGS = {
    "qwen3-norm-topk": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3-dense-between-no-norm": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1],
                                                      norm_topk_prob=False)),
    "qwen3-sparse-step-head-dim-bias": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, head_dim=24,
                                                          attention_bias=True, norm_topk_prob=True)),
    "qwen3-sliding-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6, norm_topk_prob=True)),
    "qwen2-shared-expert": ("qwen2_moe", dict()),
    "qwen2-dense-first-norm-topk": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True,
                                                      num_key_value_heads=4)),
    "qwen2-sliding-layers": ("qwen2_moe", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                               max_window_layers=2)),
    "olmoe-plain": ("olmoe", dict()),
    "olmoe-norm-topk-clip-bias": ("olmoe", dict(norm_topk_prob=True, clip_qkv=0.6, attention_bias=True,
                                                num_key_value_heads=4)),
}


def check_against(ref, model, vocab: int, new_tokens: int = 32) -> None:
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    got = model(ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4
    with torch.no_grad():
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    got_tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    model_type, overrides = CONFIGS[name]
    ref = make_family_model(model_type, seed=1, **overrides)
    ref.save_pretrained(tmp_path)
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == model_type
    check_against(ref, model, ref.config.vocab_size)


def test_layer_bookkeeping_dense_layers_and_shared_experts(tmp_path):
    ckpt = make_family_checkpoint(tmp_path, "qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0])
    model = MoEModel.from_pretrained(ckpt)
    assert model.family.moe_layers == (1, 2, 3)
    blocks = model.model.moe_blocks
    assert [b.layer_idx for b in blocks] == [0, 1, 2]  # the backend's index is the MoE index
    assert all(b.shared_expert is not None and b.shared_expert.output_gate is not None for b in blocks)
    assert len(model.experts.slot_tables) == 3  # the resident pool holds the MoE layers' experts only
    dense = model.model.layers[0].mlp
    assert not hasattr(dense, "gate") and dense.gate_proj.weight.shape == (48, 64)


def test_published_config_spellings_load_alike(tmp_path):
    """Qwen3's published config says num_experts where transformers 5.x writes num_local_experts; a sharded
    checkpoint (index + shards) loads like a single file."""
    ref = make_family_model("qwen3_moe", seed=2, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[2])
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    cfg = json.loads((tmp_path / "sharded" / "config.json").read_text())
    assert "num_local_experts" in cfg
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]  # older spelling
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(cfg))
    model = MoEModel.from_pretrained(tmp_path / "sharded")
    check_against(ref, model, 97, new_tokens=8)


def test_parse_config_as_published():
    """Field spellings of the published Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and OLMoE-1B-7B configs."""
    qwen3 = Qwen3MoeFamily.from_config_dict({
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "rms_norm_eps": 1e-6})
    assert qwen3.num_experts == 128 and qwen3.router_spec().top_k == 8 and qwen3.router_spec().renormalize
    assert len(qwen3.moe_layers) == 48 and qwen3.config.head_dim == 128 and qwen3.config.layer_windows is None
    assert qwen3.expert_spec().intermediate_size == 768
    qwen2 = Qwen2MoeFamily.from_config_dict({
        "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 21, "rope_theta": 1000000.0})
    assert qwen2.config.qkv_bias and qwen2.config.shared_expert_intermediate_size == 5632
    assert not qwen2.router_spec().renormalize and qwen2.config.layer_windows is None
    olmoe = OlmoeFamily.from_config_dict({
        "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "rope_theta": 10000})
    assert olmoe.num_experts == 64 and olmoe.config.qk_norm == "projection" and olmoe.config.rms_norm_eps == 1e-5


def fuse_experts(src, dst, num_layers: int, num_experts: int):
    """Rewrite a per-expert checkpoint with transformers 5.x's in-memory fused names."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for layer in range(num_layers):
        base = f"model.layers.{layer}.mlp.experts"
        if f"{base}.0.gate_proj.weight" not in sd:
            continue
        out[f"{base}.gate_up_proj"] = torch.stack([
            torch.cat([sd[f"{base}.{e}.gate_proj.weight"], sd[f"{base}.{e}.up_proj.weight"]])
            for e in range(num_experts)])
        out[f"{base}.down_proj"] = torch.stack([sd[f"{base}.{e}.down_proj.weight"] for e in range(num_experts)])
    save_file(out, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_fused_expert_layout_loads_like_per_expert(tmp_path, model_type):
    overrides = dict(num_hidden_layers=3, mlp_only_layers=[0]) if model_type == "qwen3_moe" else {}
    per_expert = make_family_checkpoint(tmp_path / "per", model_type, seed=4, **overrides)
    fused = fuse_experts(per_expert, tmp_path / "fused", 3, 8)
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(5))
    a = MoEModel.from_pretrained(per_expert)
    b = MoEModel.from_pretrained(fused)
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_hub_id_resolved_from_the_local_hub_cache(tmp_path, monkeypatch):
    """A hub id loads through huggingface_hub (offline here: from its cache layout)."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-olmoe" / "snapshots" / ("0" * 40)
    ref = make_family_model("olmoe", seed=6)
    ref.save_pretrained(snapshot)
    (cache / "models--tiny-org--tiny-olmoe" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-olmoe" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    model = MoEModel.from_pretrained("tiny-org/tiny-olmoe")
    assert model.family.name == "olmoe"
    check_against(ref, model, 97, new_tokens=4)
