"""moeflow's gpt-oss against transformers' GptOssForCausalLM on tiny random checkpoints (fp32), and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

from moeflow import MoEModel
from moeflow.errors import CheckpointError, UnsupportedQuantizationError
from moeflow.moe.routing import RouterSpec, make_router

CONFIGS = {  # sliding window 4 < the 12-token prompts + 32 new tokens: the sliding layers really slide
    "E4-top2-sliding-full": {},
    "E5-top1-3-layers": dict(num_local_experts=5, num_experts_per_tok=1, num_hidden_layers=3),
    "E3-top3-full-sliding-odd-heads": dict(num_local_experts=3, num_experts_per_tok=3, num_attention_heads=6,
                                           num_key_value_heads=3, layer_types=["full_attention", "sliding_attention"]),
    "E8-top4-mha-all-sliding": dict(num_local_experts=8, num_experts_per_tok=4, num_key_value_heads=4,
                                    layer_types=["sliding_attention", "sliding_attention"]),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compare(ref, model, vocab: int, seed: int = 3, logits_tol: float = 1e-4) -> None:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(ids).logits
    got = model(ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) < logits_tol
    with torch.no_grad():
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got_tokens = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=[])
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    ref = make_gpt_oss_model(seed=1, **CONFIGS[name])
    save_gpt_oss_checkpoint(ref, tmp_path)
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == "gpt_oss"
    compare(ref, model, ref.config.vocab_size)


def test_left_padded_batch_matches_transformers(tmp_path):
    ref = make_gpt_oss_model(seed=2)
    save_gpt_oss_checkpoint(ref, tmp_path)
    model = MoEModel.from_pretrained(tmp_path)
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want_logits = ref(ids, attention_mask=mask).logits
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    real = mask.bool()
    assert rel_err(model(ids, attention_mask=mask).logits[real], want_logits[real]) < 1e-4
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                      eos_token_id=[]), want)


def test_router_takes_topk_of_logits_then_softmax():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=16, num_local_experts=7, num_experts_per_tok=3)
    torch.manual_seed(0)
    ref = GptOssTopKRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    x = torch.randn(11, 16)
    logits, want_w, want_ids = ref(x)
    probs, ids, weights = make_router(RouterSpec(top_k=3, topk_before_scoring=True, router_bias=True))(logits)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_yarn_frequencies_match_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from moeflow.families.gpt_oss import GptOssFamily

    # gpt-oss-120b's rope (head_dim, theta, YaRN scaling, context); one small layer: the rest does not touch it
    cfg = GptOssConfig(head_dim=64, num_attention_heads=64, hidden_size=2880, num_hidden_layers=1,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, vocab_size=64)
    family = GptOssFamily.from_config_dict(json.loads(cfg.to_json_string()))
    decoder = family.build_decoder(torch.float32, lambda _n, i, o: torch.nn.Linear(i, o, bias=False))
    want = GptOssRotaryEmbedding(cfg)
    pos = torch.arange(0, 5000, 7)[None]
    cos, sin = want(torch.zeros(1), pos)
    got_cos, got_sin = decoder.rotary(pos, torch.float32)
    torch.testing.assert_close(got_cos[..., :32], cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_sin[..., 32:], sin, rtol=0, atol=1e-6)
    assert decoder.rotary.attention_factor > 1.0


# ------------------------------------------------------------------ bad input


@pytest.fixture()
def tiny_dir(tmp_path):
    return save_gpt_oss_checkpoint(make_gpt_oss_model(seed=4), tmp_path)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_layer_types_of_wrong_length_is_refused(tiny_dir):
    _edit_config(tiny_dir, layer_types=["sliding_attention"] * 3)
    with pytest.raises(CheckpointError, match="layer_types has 3 entries but num_hidden_layers is 2"):
        MoEModel.from_pretrained(tiny_dir)


def test_unknown_layer_type_is_refused(tiny_dir):
    _edit_config(tiny_dir, layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(CheckpointError, match="layer_types holds .*chunked_attention"):
        MoEModel.from_pretrained(tiny_dir)


def test_unsupported_quant_method_is_refused(tiny_dir):
    _edit_config(tiny_dir, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(UnsupportedQuantizationError, match="quantization_config.quant_method 'bitsandbytes'"):
        MoEModel.from_pretrained(tiny_dir)


def test_unsupported_rope_type_is_refused(tiny_dir):
    _edit_config(tiny_dir, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="rope_type 'longrope'"):
        MoEModel.from_pretrained(tiny_dir)


# ------------------------------------------------------------------ MXFP4 experts as published


@pytest.mark.parametrize("name", ["E4-top2-sliding-full", "E5-top1-3-layers"])
def test_mxfp4_experts_match_transformers_on_dequantized_weights(tmp_path, name):
    """Dequantizing e2m1 x 2^e is exact in fp32, so the tolerance is the fp32 one (1e-4 relative) on the torch
    reference (kernels="torch"; "auto" on the CPU takes the native kernel's int8 activations: the next test)."""
    ref = make_gpt_oss_model(seed=5, **CONFIGS[name])
    save_gpt_oss_checkpoint(ref, tmp_path, mxfp4=True)  # ref now holds the dequantized expert weights
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, kernels="torch")
    assert not model.experts.fmt.cpu_kernels
    fmt = model.experts.fmt
    assert fmt.kind == "mxfp4" and model.experts.pool.tensors["w13_blocks"].dtype == torch.uint8
    H, I = ref.config.hidden_size, ref.config.intermediate_size  # noqa: E741
    assert fmt.nbytes < 2 * I * H  # 4.25 bits a weight (+ biases), far below bf16's 16
    compare(ref, model, ref.config.vocab_size)


def test_mxfp4_experts_on_the_native_cpu_kernel(tmp_path):
    """device="cpu", kernels="auto": the experts on moeflow/kernels/cpu/mxfp4.c (int8 activations per 32): logits
    within 5e-2 (max-relative) of transformers on the dequantized weights (measured ~2e-2). The attention kept in
    fp32 (attention_bits=None): this random tiny model turns the int8 attention's ~0.8% per projection into up to
    ~35% on a row's logits, as it does 0.8% noise added to its fp32 weights (test_gpt_oss_cpu_linears.py)."""
    from moeflow.kernels.cpu.native import native_available

    if not native_available():
        pytest.skip("moeflow's CPU kernels do not build here")
    ref = make_gpt_oss_model(seed=5)
    save_gpt_oss_checkpoint(ref, tmp_path, mxfp4=True)
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, attention_bits=None)
    assert model.experts.fmt.cpu_kernels
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    err = rel_err(model(ids).logits, want)
    assert 0 < err < 5e-2  # not the reference path (0 < err), within int8 activations' error


def test_mxfp4_experts_through_the_triton_kernels(tmp_path):
    """The MXFP4 Triton kernels (interpreted) inside the model: logits and greedy tokens of transformers."""
    ref = make_gpt_oss_model(seed=8, num_local_experts=5, num_experts_per_tok=2)
    save_gpt_oss_checkpoint(ref, tmp_path, mxfp4=True)
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, kernels="triton")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    assert rel_err(model(ids).logits, want) < 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[]), want_tokens)


def test_mxfp4_blocks_that_disagree_with_scales_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_gpt_oss_checkpoint(make_gpt_oss_model(seed=6), tmp_path, mxfp4=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][..., :-1].contiguous()  # one block of scales short
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        MoEModel.from_pretrained(tmp_path)


def test_mxfp4_blocks_without_quantization_config_are_refused(tmp_path):
    save_gpt_oss_checkpoint(make_gpt_oss_model(seed=6), tmp_path, mxfp4=True)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config.quant_method 'mxfp4'"):
        MoEModel.from_pretrained(tmp_path)


# ------------------------------------------------------------------ moeflow quantize: AWQ int4 experts


def test_quantized_bf16_gpt_oss_loads_with_awq_experts(tmp_path):
    """``moeflow quantize`` on a bf16/fp32 gpt-oss: per-expert AWQ gate/up/down, biases kept; moeflow's AWQ model
    matches transformers run on the dequantized AWQ weights (1e-4; RTN's own error is not tested here)."""
    from safetensors.torch import load_file

    from moeflow.quant.awq import dequantize
    from moeflow.tools.quantize import quantize_checkpoint

    ref = make_gpt_oss_model(seed=9, num_local_experts=5, num_experts_per_tok=2)
    save_gpt_oss_checkpoint(ref, tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "awq", group_size=32, dtype=torch.float16, progress=False)
    tensors = load_file(tmp_path / "awq" / "model.safetensors")
    assert not any(n.endswith("experts.gate_up_proj") for n in tensors)
    with torch.no_grad():  # the reference: transformers with the dequantized AWQ expert weights (fp16 scales)
        for name, p in ref.named_parameters():  # everything else went through fp16
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(p.half().float())
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            for e in range(experts.num_experts):
                def deq(part, i=i, e=e):
                    base = f"model.layers.{i}.mlp.experts.{e}.{part}"
                    return dequantize(tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"],
                                      tensors[f"{base}.scales"].float(), 32)  # [in, out]
                experts.gate_up_proj[e, :, 0::2] = deq("gate_proj")
                experts.gate_up_proj[e, :, 1::2] = deq("up_proj")
                experts.down_proj[e] = deq("down_proj")
    model = MoEModel.from_pretrained(tmp_path / "awq", device="cpu", dtype=torch.float32)
    assert model.experts.fmt.kind == "awq" and model.experts.fmt.bias
    compare(ref, model, ref.config.vocab_size)


def test_compiled_decode_is_one_graph(tmp_path):
    """Sink attention, per-layer masks and the biased experts (a custom op) trace as one graph, no recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    save_gpt_oss_checkpoint(make_gpt_oss_model(seed=3, num_hidden_layers=2), tmp_path)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    want = MoEModel.from_pretrained(tmp_path).generate(ids, max_new_tokens=9, eos_token_id=[])
    torch._dynamo.reset()
    counters.clear()
    model = MoEModel.from_pretrained(tmp_path, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, max_new_tokens=9, eos_token_id=[])
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_clamped_swiglu_matches_transformers_past_the_limit():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from moeflow.kernels.experts.biased import gate_activation
    from moeflow.kernels.formats import biased_expert_format

    experts = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=32, num_local_experts=2))
    gate_up = torch.linspace(-20, 20, 2 * 64).reshape(2, 64)[:, torch.randperm(64)]  # interleaved gate/up
    fmt = biased_expert_format(32, 32, "dense", torch.float32, activation="clamped_swiglu")
    ours = gate_activation(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1), fmt)
    assert torch.equal(ours, experts._apply_gate(gate_up))
    assert (gate_up.abs() > 7).any()


def test_biased_format_layout():
    from moeflow.kernels.formats import biased_expert_format, expert_format

    plain = expert_format(64, 96, "awq", torch.float16, 32)
    biased = biased_expert_format(64, 96, "awq", torch.float16, 32, activation="clamped_swiglu")
    assert biased.names == plain.names + ("w13_bias", "w2_bias")
    # biased AWQ experts keep the plain kernels' layout (the AWQ Triton kernels read them), biases after it
    assert biased.spec("w13_qweight").shape == plain.spec("w13_qweight").shape and biased.nbytes > plain.nbytes
    assert biased.spec("w2_scales").offset == plain.spec("w2_scales").offset
    mx = biased_expert_format(2880, 2880, "mxfp4", torch.bfloat16, 32, activation="clamped_swiglu")
    # MXFP4 regions in K panels of 64 (45 of them at K = 2880); the loader form stays as published
    assert mx.spec("w13_blocks").shape == (45, 5760, 2, 16) and mx.spec("w2_scales").shape == (45, 2880, 2)
    assert mx.loader_shapes()["w13_blocks"] == (5760, 90, 16) and mx.loader_shapes()["w2_scales"] == (2880, 90)
    with pytest.raises(ValueError, match="divisible by 32"):
        biased_expert_format(64, 48, "mxfp4", torch.bfloat16, 32)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        biased_expert_format(64, 64, "dense", torch.float32, activation="gelu")
