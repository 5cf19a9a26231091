"""Qwen3-Next's / Qwen3.5-MoE's multi-token-prediction layer (``mtp.*``): shapes and names against the published
Qwen3-Next-80B-A3B config, the layer's logits against an fp32 reference built on transformers' decoder layer, and
``generate(num_speculative_tokens=k)`` on a hybrid (Gated DeltaNet) model: greedy tokens = plain greedy, resident and
under every offload policy that runs without trained predictors, with the linear-attention states rolled back past
rejected drafts (random drafts: most are rejected; oracle drafts: accepted, and cut at wrong ones); Qwen3.5-MoE's
text model. ``moeflow quantize`` keeps the MTP layer. ~16 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from mtp_helpers import mtp_layer_logits, routed_layers
from qwen_mtp_helpers import make_qwen_mtp_checkpoint, reference_qwen_mtp_logits
from torch import nn

import moeflow.engine.mtp as mtp_engine
from moeflow import MoEModel, OffloadConfig
from moeflow.errors import CheckpointError
from moeflow.families import family_for_config
from moeflow.families.gated_deltanet import ZeroCenteredRMSNorm
from moeflow.offload.policies import POLICY_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10
# policies that run without trained predictor files over dense experts (fiddler needs AWQ: tests/test_hybrid.py)
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler", "duoserve", "promoe", "expertflow"))
# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (benchmarks/common/family_writers.py) and its MTP layer count
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "mlp_only_layers": [], "decoder_sparse_step": 1,
    "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, ref, own = make_qwen_mtp_checkpoint(tmp_path_factory.mktemp("qwen_mtp"), seed=4)
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    return path, ref, own, model, ids, plain


def test_published_qwen3_next_mtp_shapes_and_names():
    family = family_for_config(QWEN3_NEXT_80B)
    assert family.num_mtp_layers() == 1 and family.mtp_config_field == "mtp_num_hidden_layers"
    with torch.device("meta"):
        mtp = family.build_mtp(torch.bfloat16, lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias))
    names = {family.mtp_checkpoint_name(p, None): tuple(t.shape) for p, t in mtp.named_parameters()}
    assert names["mtp.fc.weight"] == (2048, 2 * 2048)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert names[f"mtp.{norm}.weight"] == (2048,)
    assert names["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)  # queries and their output gate
    assert names["mtp.layers.0.self_attn.k_proj.weight"] == (2 * 256, 2048)
    assert names["mtp.layers.0.self_attn.q_norm.weight"] == (256,)
    assert names["mtp.layers.0.mlp.gate.weight"] == (512, 2048)
    assert names["mtp.layers.0.mlp.shared_expert.up_proj.weight"] == (512, 2048)
    assert names["mtp.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert not any("embed_tokens" in n or "lm_head" in n or "linear_attn" in n for n in names)
    (block,) = mtp.moe_blocks
    assert block.layer_idx == 48 == len(family.moe_layers)  # the backend's MoE layer after the decoder's 48
    layer = mtp.layers[0]
    assert layer.block.self_attn.kv_idx == 0 and isinstance(layer.enorm, ZeroCenteredRMSNorm)
    assert not layer.zero_first_embedding
    without = family_for_config({**QWEN3_NEXT_80B, "mtp_num_hidden_layers": 0})
    assert without.num_mtp_layers() == 0


def test_mtp_layer_matches_the_fp32_reference(tiny):
    path, ref, own, model, _, _ = tiny
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    want = reference_qwen_mtp_logits(ref, own, ids)  # [7, V]: positions 0..6
    got = mtp_layer_logits(model, ids)[1][0]
    assert got.shape == want.shape == (ids.shape[1] - 1, 97)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_loading_without_the_mtp_tensors_names_them(tmp_path):
    path, _, _ = make_qwen_mtp_checkpoint(tmp_path, seed=2, with_mtp=False)
    model = MoEModel.from_pretrained(path)  # the main model loads without them
    assert model.mtp is None
    with pytest.raises(CheckpointError, match="mtp.fc.weight|mtp.pre_fc_norm|mtp.layers.0"):
        MoEModel.from_pretrained(path, mtp=True)
    with pytest.raises(ValueError, match="mtp=True"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, num_speculative_tokens=1)


@pytest.mark.parametrize("k", [1, 3])
def test_resident_tokens_equal_plain_greedy(tiny, k):
    *_, model, ids, plain = tiny
    model.stats.reset()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=k)
    assert torch.equal(out, plain)
    s = model.stats
    assert s.generated_tokens == NEW and s.accepted_tokens <= s.draft_tokens and s.draft_tokens > 0


def test_left_padding_and_eos(tiny):
    *_, model, ids, plain = tiny
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                         num_speculative_tokens=2)
    assert torch.equal(got, want)
    eos = int(plain[0, ids.shape[1] + 4])
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                      num_speculative_tokens=3), want)


def test_speculative_sampling_with_top_k_1_is_greedy(tiny):
    """Sampling restricted to the top token: draft and target distributions are one-hot, so speculative sampling's
    accept / resample steps (and the state rollback after a resample) give plain greedy's tokens."""
    *_, model, ids, plain = tiny
    model.stats.reset()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=[], seed=3,
                         num_speculative_tokens=2)
    assert torch.equal(out, plain)
    assert model.stats.draft_tokens > model.stats.accepted_tokens  # some drafts rejected: the rollback ran


@pytest.mark.parametrize("wrong_every", [None, 3])
def test_oracle_drafts_roll_the_linear_state_back(tiny, monkeypatch, wrong_every):
    """Drafts from the plain greedy tokens: all accepted; every third wrong: cut there, the DeltaNet states put
    back and advanced over the kept tokens only, so every later token is still plain greedy's."""
    *_, model, ids, plain = tiny
    seq = plain[0].tolist()

    def oracle(drafter, mtp_in, k, n, pad, history, device, choose=None):
        draft = [(tok + 1) % 97 if wrong_every and (n + j) % wrong_every == 0 else tok
                 for j, tok in enumerate(seq[n:n + k])]
        return draft, [None] * len(draft)

    monkeypatch.setattr(mtp_engine, "propose", oracle)
    model.stats.reset()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3)
    assert torch.equal(out, plain)
    s = model.stats
    if wrong_every is None:
        assert s.accepted_tokens == s.draft_tokens and s.decode.steps == 3  # 1 + 4 + 4 + 1 tokens, no rollback
    else:
        # cut at each wrong draft, no second pass of the model for the rollback (the DeltaNet layers alone rerun)
        assert (s.draft_tokens, s.accepted_tokens, s.decode.steps) == (8, 6, 3)


def test_without_rollback_the_tokens_would_differ(tiny, monkeypatch):
    """The rollback is what keeps the tokens exact: with the state snapshot disabled, a rejected draft's tokens
    stay in the DeltaNet states and the output leaves plain greedy's."""
    from moeflow.engine.linear_state import HybridKVCache

    *_, model, ids, plain = tiny
    monkeypatch.setattr(HybridKVCache, "snapshot", lambda self: (lambda: None))
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3)
    assert not torch.equal(out, plain)


@pytest.mark.parametrize("n_slots", [2, 5])
def test_lru_with_few_slots_equals_plain_greedy(tiny, n_slots):
    """LRU over a few of the 24 experts: the MTP passes route through MoE layer 3 (the MTP layer's, after the
    decoder's 3), whose experts are looked up like the decoder's; tokens = plain greedy."""
    path, *_, ids, plain = tiny
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy="lru", gpu_expert_slots=n_slots))
    with routed_layers(model) as seen:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=2)
    assert torch.equal(out, plain)
    assert seen.count(3) > 0 and set(seen) == {0, 1, 2, 3}
    assert model.stats.decode.misses > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_offload_policies_equal_plain_greedy(tiny, policy):
    path, *_, ids, plain = tiny
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy=policy, gpu_expert_slots=3))
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3)
    finally:
        model.experts.close()
    assert torch.equal(out, plain), policy


def test_quantize_keeps_the_mtp_layer(tiny, tmp_path):
    """`moeflow quantize` keeps the ``mtp.*`` tensors, the MTP layer's experts in AWQ like the decoder's; the
    quantized model drafts with the plain greedy tokens of the same quantized model (CPU int4 kernels)."""
    from safetensors import safe_open

    from moeflow.tools.quantize import quantize_checkpoint

    path, *_, ids, _ = tiny
    dst = quantize_checkpoint(path, tmp_path / "awq", group_size=32, progress=False)
    with safe_open(dst / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"} <= names
    assert "mtp.layers.0.mlp.experts.0.gate_proj.qweight" in names
    assert not any(n.startswith("mtp.layers.0.mlp.experts.") and n.endswith(("gate_up_proj", ".weight"))
                   for n in names)
    model = MoEModel.from_pretrained(dst, mtp=True, offload=OffloadConfig(policy="lru", gpu_expert_slots=3))
    try:
        plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3)
    finally:
        model.experts.close()
    assert torch.equal(out, plain)


@pytest.mark.parametrize("kind", ["qwen3_5_moe_text", "qwen3_5_moe"])
def test_qwen35_reads_and_drafts(tmp_path, kind):
    """Qwen3.5-MoE: the text-only checkpoint and the published conditional-generation one (``text_config``, text
    weights under ``model.language_model``, a vision tower; the MTP layer under ``mtp.`` all the same)."""
    path, _, _ = make_qwen_mtp_checkpoint(tmp_path, seed=6, kind=kind)
    model = MoEModel.from_pretrained(path, mtp=True)
    assert model.family.name == "qwen3_5_moe" and model.mtp is not None
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    model.stats.reset()
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[],
                                      num_speculative_tokens=2), plain)
    assert model.stats.draft_tokens > 0


def test_published_qwen35_397b_mtp_shapes():
    """Qwen3.5-397B-A17B's config.json nests the text model in text_config (60 layers, hidden 4096, 32 query heads
    and 2 KV heads of 256, 512 experts top-10, every layer MoE, 3 DeltaNet layers per full-attention layer, one MTP
    layer; as NVIDIA's Megatron description of the model gives them); the MTP layer's names stay top-level
    ``mtp.*``. The DeltaNet head counts and intermediate sizes below are placeholders the asserted shapes do not
    depend on."""
    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
            "shared_expert_intermediate_size": 1024, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
            "mtp_num_hidden_layers": 1}
    family = family_for_config({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False})
    assert family.name == "qwen3_5_moe" and family.num_mtp_layers() == 1
    with torch.device("meta"):
        mtp = family.build_mtp(torch.bfloat16, lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias))
    names = {family.mtp_checkpoint_name(p, None): tuple(t.shape) for p, t in mtp.named_parameters()}
    assert names["mtp.fc.weight"] == (4096, 8192)
    assert names["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 32 * 256, 4096)
    assert names["mtp.layers.0.self_attn.v_proj.weight"] == (2 * 256, 4096)
    assert names["mtp.layers.0.mlp.gate.weight"] == (512, 4096)
    assert mtp.moe_blocks[0].layer_idx == 60 == len(family.moe_layers)
