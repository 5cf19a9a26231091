"""Qwen3-Next and Qwen3.5-MoE (hybrid Gated DeltaNet / gated-attention MoE) through ``moeflow.MoEModel`` against
transformers' own models on tiny random checkpoints: fp32 logits within 1e-4 and 32 greedy tokens, for one prompt
and a left-padded batch; Qwen3.5 as published (the conditional-generation checkpoint, a vision tower beside the text
model) and as a text-only checkpoint; AWQ experts; micro-batches over cache rows; the config.json variants refused by
name."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_hybrid import QWEN3_5_MOE, QWEN3_NEXT, make_checkpoint

from moeflow import MoEModel
from moeflow.errors import CheckpointError

transformers = pytest.importorskip("transformers")
CASES = [("qwen3_next", name) for name in QWEN3_NEXT] + [("qwen3_5_moe", name) for name in QWEN3_5_MOE] + \
    [("qwen3_5_moe_text", "full-first-mrope")]
CASES_BY_KIND = {"qwen3_next": QWEN3_NEXT["interval2-gqa-dense-first"],
                 "qwen3_5_moe_text": QWEN3_5_MOE["full-first-mrope"]}
FAMILY = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}


def shapes(kind: str) -> dict:
    return QWEN3_NEXT if kind == "qwen3_next" else QWEN3_5_MOE


def assert_matches(model, ref, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int = 32) -> None:
    """Logits of the real positions within 1e-4 (relative to the largest) and ``new_tokens`` greedy tokens equal."""
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        want_tokens = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert got.shape == want.shape
    assert float((got[real] - want[real]).abs().max() / want[real].abs().max()) < 1e-4
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
    assert torch.equal(tokens, want_tokens)
    assert len(set(tokens[0, ids.shape[1]:].tolist())) > 3  # not one token repeated: the check can fail


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind, name):
    path, ref = make_checkpoint(tmp_path, kind, seed=1, **shapes(kind)[name])
    model = MoEModel.from_pretrained(path, device="cpu", dtype=torch.float32)
    assert model.family.name == FAMILY[kind]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, 11), generator=gen)
    assert_matches(model, ref, ids, torch.ones_like(ids))
    batch = torch.randint(0, 97, (2, 13), generator=gen)
    mask = torch.ones_like(batch)
    mask[1, :5] = 0  # left padding
    assert_matches(model, ref, batch, mask)


def test_qwen3_5_as_published_reads_only_the_text_model(tmp_path):
    """The conditional-generation checkpoint nests the text model under ``model.language_model``, beside a vision
    tower: moeflow reads the text config and weights and never the vision ones (nor MTP ones)."""
    from safetensors import safe_open

    path, _ = make_checkpoint(tmp_path, "qwen3_5_moe", seed=2, **QWEN3_5_MOE["interval3-tied"])
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.visual.") for n in names)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and "vision_config" in config
    model = MoEModel.from_pretrained(path)
    assert model.config.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert model.config.tie_word_embeddings and model.family.moe_layers == (0, 1, 2)
    assert not any("visual" in n for n, _ in model.model.named_parameters())


def test_micro_batches_over_cache_rows_give_the_whole_batch_tokens(tmp_path):
    """ExpertFlow's micro-batches read and write the linear-attention states of their own rows."""
    path, _ = make_checkpoint(tmp_path, "qwen3_next", seed=3, **QWEN3_NEXT["interval2-gqa-dense-first"])
    model = MoEModel.from_pretrained(path)
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    whole = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
    for size in (1, 2):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[],
                             micro_batch_size=size)
        assert torch.equal(got, whole), size


def test_a_second_generate_starts_from_empty_states(tmp_path):
    """A kept cache (CUDA graphs reuse it across calls) is cleared: its linear states start at zero again."""
    path, _ = make_checkpoint(tmp_path, "qwen3_5_moe_text", seed=5, **QWEN3_5_MOE["full-first-mrope"])
    model = MoEModel.from_pretrained(path)
    model.runner.reuse_cache = True
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(6))
    first = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    cache = model.runner._last_cache[1]
    assert cache.linear.recurrent.abs().sum() > 0
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[]), first)
    assert model.runner._last_cache[1] is cache


def test_awq_checkpoint_matches_transformers_on_dequantized_weights(tmp_path):
    """``moeflow quantize`` of the published-shape Qwen3.5 checkpoint (experts under ``model.language_model``) to
    AWQ group 32: the experts load into the AWQ pool and compute what transformers computes on them dequantized."""
    from safetensors.torch import load_file

    from moeflow.quant.awq import dequantize
    from moeflow.tools.quantize import quantize_checkpoint

    src, ref = make_checkpoint(tmp_path / "src", "qwen3_5_moe", seed=2, **QWEN3_5_MOE["full-first-mrope"])
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=32, progress=False)
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    sd = load_file(dst / "model.safetensors")
    state = {k: v.float() for k, v in sd.items() if ".mlp.experts." not in k}
    for layer in model.family.moe_layers:
        base = f"model.language_model.layers.{layer}.mlp.experts"
        w = [{p: dequantize(sd[f"{base}.{e}.{p}.qweight"], sd[f"{base}.{e}.{p}.qzeros"],
                            sd[f"{base}.{e}.{p}.scales"].float(), 32).T for p in ("gate_proj", "up_proj", "down_proj")}
             for e in range(6)]
        state[f"{base}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in w])
        state[f"{base}.down_proj"] = torch.stack([x["down_proj"] for x in w])
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [n for n in missing if n != "lm_head.weight"], (missing, unexpected)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert_matches(model, ref.eval(), ids, mask)


@pytest.mark.parametrize(("change", "match"), [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "sliding_attention"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "2 entries"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attn_output_gate": False}, "attn_output_gate=False"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim=1"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
    ({"partial_rotary_factor": 0.1, "rope_parameters": None}, "partial_rotary_factor=0.1"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, match):
    make_checkpoint(tmp_path, "qwen3_next", **QWEN3_NEXT["interval2-gqa-dense-first"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        MoEModel.from_pretrained(tmp_path)


def test_rope_parameters_factor_wins_over_a_stale_top_level_one(tmp_path):
    """transformers 5.17 (the lent GPU machine's) writes a top-level partial_rotary_factor 0.25 (its default) beside
    rope_parameters' own, and its model turns rope_parameters' share of each head; moeflow reads that one too."""
    make_checkpoint(tmp_path, "qwen3_next", **QWEN3_NEXT["interval4-mha-unnormalised"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    (tmp_path / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.25}))
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32)
    try:
        assert model.family.config.partial_rotary_factor == 0.5
    finally:
        model.close()


def test_conditional_config_without_text_config_is_refused(tmp_path):
    make_checkpoint(tmp_path, "qwen3_5_moe", **QWEN3_5_MOE["interval3-tied"])
    config = json.loads((tmp_path / "config.json").read_text())
    del config["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config, which is missing"):
        MoEModel.from_pretrained(tmp_path)


@pytest.mark.usefixtures("one_thread")
def test_awq_experts_on_the_cpu_int4_path_keep_the_invariant(tmp_path):
    """A Qwen3-Next AWQ checkpoint (per-expert names under ``model.layers``) on the CPU int4 kernels: the torch
    reference's tokens, and fiddler (AWQ only) and lru offloading give the resident tokens."""
    from moeflow import OffloadConfig
    from moeflow.tools.quantize import quantize_checkpoint

    src, _ = make_checkpoint(tmp_path / "src", "qwen3_next", seed=2, **QWEN3_NEXT["interval2-gqa-dense-first"])
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=32, progress=False)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def tokens(**kw):
        model = MoEModel.from_pretrained(dst, **kw)
        try:
            return model.kernels, model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                                 eos_token_id=[])
        finally:
            model.close()

    _, want = tokens(kernels="torch")
    kernels, resident = tokens()
    assert kernels == "cpu-int4" and torch.equal(resident, want)
    for policy in ("fiddler", "lru"):
        assert torch.equal(tokens(offload=OffloadConfig(policy=policy, gpu_expert_slots=5))[1], resident), policy
    with pytest.raises(ValueError, match="attention_bits=8: qwen3_next's gated attention"):
        MoEModel.from_pretrained(dst, attention_bits=8)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_text"])
def test_bf16_matches_transformers_in_bf16(tmp_path, kind):
    """In bf16 (fp32 delta rule, decays and norms; projections, conv and attention in bf16, as transformers computes
    them) against transformers' model loaded in bf16: the same logits (1e-3) over one pass, and 24 greedy tokens
    each of which is transformers' top choice within the bf16 rounding noise.

    Two bf16 implementations cannot be asked for identical greedy tokens: where the reference's top-1/top-2 margin is
    below the rounding noise, the CPU's bf16 matmul kernels (AVX2 vs AVX-512-BF16 round differently) pick the token.
    Measured on Zen 4 (AVX-512-BF16), transformers 5.24: transformers' own decode-step logits differ from its
    one-pass logits of the same sequence by up to 0.03 (qwen3_next) and 0.40 (qwen3_5: a router near-tie flips an
    expert at one step), and its decode margins fall to 0.00-0.02 at steps 14 and 19, where moeflow on that CPU took
    the other token of the tie. So the tokens are compared only up to the reference's first near-tie, and every token
    moeflow chooses must be within that noise of the best logit transformers gives over moeflow's own sequence."""
    cls = transformers.Qwen3NextForCausalLM if kind == "qwen3_next" else transformers.Qwen3_5MoeForCausalLM
    path, _ = make_checkpoint(tmp_path, kind, seed=4, **CASES_BY_KIND[kind])
    ref = cls.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = MoEModel.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(8))
    t, new = ids.shape[1], 24
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want_tokens = out.sequences
        ref_steps = torch.stack(out.logits, 1).float()[0]  # [new, vocab]: transformers' decode-step logits
        ref_pass = ref(want_tokens).logits.float()[0, t - 1:-1]  # [new, vocab]: the same logits in one pass
    # one pass over the prompt and transformers' continuation: the two bf16 implementations agree
    got_pass = model(want_tokens).logits[0, t - 1:-1]
    assert float((got_pass - ref_pass).abs().max() / ref_pass.abs().max()) < 1e-3
    # the same logits computed two ways (decode steps, one pass), both by transformers in bf16: the rounding noise
    noise = (ref_steps - ref_pass).abs().max(dim=1).values  # [new]
    assert float(noise.median()) < 0.03 * float(ref_pass.abs().max())  # bf16 rounding, not a broken reference
    step_tol = 2 * noise.clamp(min=float(noise.median()))  # a router near-tie makes single steps much noisier

    tokens = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
    top2 = ref_steps.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > step_tol).long()  # the reference's steps without a near-tie
    up_to_tie = int(clear.cumprod(0).sum())
    assert torch.equal(tokens[0, t:t + up_to_tie], want_tokens[0, t:t + up_to_tie])
    # moeflow's decode path (its KV cache and recurrent states), judged by transformers over moeflow's own tokens
    with torch.no_grad():
        judged = ref(tokens).logits.float()[0, t - 1:-1]
    chosen = judged.gather(1, tokens[0, t:, None])[:, 0]
    assert float((judged.max(dim=1).values - chosen).max()) <= 2 * float(noise.max())
    assert len(set(tokens[0, t:].tolist())) > 3  # not one token repeated: the check can fail
