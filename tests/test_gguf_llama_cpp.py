"""GGUF files made by llama.cpp's own tools from the tests' tiny transformers checkpoints: ``convert_hf_to_gguf.py``
(f32) then ``llama-quantize`` (Q4_K_M, Q5_K_M, Q6_K, Q4_0, Q8_0). moeflow's greedy tokens (32) and logits on the
file equal transformers' on the same weights: transformers' own GGUF loader for Qwen3-MoE, else the HF model holding
gguf-py's dequantization of the file. gpt-oss: the converter's MXFP4 repack of a published-layout checkpoint, and
llama-quantize's MXFP4_MOE, Q8_0, Q4_K_M (Q5_0 at these sizes) and Q4_0 (the biased AWQ format) of its f32 file.
deepseek2 (tests/gguf_deepseek2.py's reference): DeepSeek-V3- and V2-Lite-shaped checkpoints and a GLM-4.7-Flash-like
one (an MTP layer in block_count), f32 against transformers itself, Q4_0 / Q8_0 / Q4_K_M against the dequantized file,
and the f32 files' greedy tokens against llama.cpp's own (``llama-completion``, when built).

Needs a llama.cpp source tree with ``llama-quantize`` built (llama-cpp-python's sdist vendors one; see
benchmarks/peers/build_llama_cpp.sh): ``MOEFLOW_LLAMA_CPP_DIR=<tree> pytest tests/test_gguf_llama_cpp.py``; skipped
without it. 2.5 to 4.5 min on 2 cores for the first 20 conversions (127 s at load 4.6 for the first 15, gpt-oss's
5 about 30 s); all 30: about 11 min at load 8.5 (the deepseek2 ones about 30 s each at that load).
The tiny vocabulary's BPE pre-tokenizer is unknown to the converter's hash table: it is told "qwen2"
(the vocabulary is the test's, the weights are what is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
LLAMA_CPP = Path(os.environ.get("MOEFLOW_LLAMA_CPP_DIR", "/nonexistent"))
QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"
pytestmark = pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file() or not QUANTIZE.is_file(),
    reason="MOEFLOW_LLAMA_CPP_DIR (llama.cpp sources with build/bin/llama-quantize) not set")

from family_models import make_family_model  # noqa: E402
from gguf_models import reference_from_file  # noqa: E402
from helpers import make_tiny_model  # noqa: E402
from tiny_families import make_model  # noqa: E402

from moeflow import MoEModel  # noqa: E402

CONVERT = """import runpy, sys
sys.path.insert(0, {src!r}); sys.path.insert(1, {src!r} + "/gguf-py")
import conversion.base as base
import conversion.glm as glm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
glm.Glm4MoeModel.set_vocab = glm.Glm4MoeLiteModel.set_vocab = lambda self: self._set_vocab_gpt2()  # (not [gMASK])
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
SIZES = {"mixtral": dict(hidden_size=256, intermediate_size=256),
         "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, head_dim=32, norm_topk_prob=True),
         "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256),
         "olmoe": dict(hidden_size=256, intermediate_size=256),
         "glm4_moe": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_key_value_heads=2,
                          head_dim=64, use_qk_norm=True, attention_bias=True, first_k_dense_replace=1,
                          norm_topk_prob=True, routed_scaling_factor=2.5, partial_rotary_factor=0.5),
         "minimax_m2": dict(hidden_size=256, intermediate_size=256, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                            use_qk_norm=True, use_routing_bias=True),
         # MLA sizes llama-quantize keeps mostly quantized; V3: sigmoid router with groups, YaRN (mscale ==
         # mscale_all_dim, as llama.cpp's graph takes them); V2-Lite: one q_proj, softmax, greedy
         "deepseek_v3": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_key_value_heads=4,
                             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             q_lora_rank=64, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 64, "mscale": 0.9,
                                              "mscale_all_dim": 0.9, "beta_fast": 32, "beta_slow": 1}),
         "deepseek_v2": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_key_value_heads=4,
                             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1, n_shared_experts=2,
                             routed_scaling_factor=1.0),
         # GLM-4.7-Flash-like: its dense first layer said by mlp_layer_types, an MTP layer counted in block_count
         "glm4_moe_lite": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                               num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                               v_head_dim=32, q_lora_rank=64, n_shared_experts=1, routed_scaling_factor=1.8,
                               norm_topk_prob=True, mlp_layer_types=["dense", "sparse", "sparse"])}
# config.json entries the published checkpoints have and transformers' tiny configs do not keep
CONFIG_PATCH = {"deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc"),
                "glm4_moe_lite": dict(scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1,
                                      num_nextn_predict_layers=1)}


def save_tokenizer(directory: Path, size: int) -> None:
    """A byte-level BPE of ``size`` tokens (the bytes from the space on, one merge, three special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [c for _, c in sorted(bytes_to_unicode().items())][32:32 + size - 4]
    vocab = {t: i for i, t in enumerate([*chars, "ab"])}
    tok = Tokenizer(models.BPE(vocab, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    assert len(fast) == size
    fast.save_pretrained(directory)


def converted(tmp_path: Path, model_type: str, qtype: str | None, **overrides):
    if model_type == "mixtral":
        src = make_tiny_model(seed=5, **SIZES[model_type])
    elif model_type in ("glm4_moe", "minimax_m2", "deepseek_v3", "deepseek_v2", "glm4_moe_lite"):
        src = make_model(model_type, seed=5, **{**SIZES[model_type], **overrides})
    else:
        src = make_family_model(model_type, seed=5, **SIZES[model_type])
    hf = tmp_path / "hf"
    src.save_pretrained(hf)
    save_tokenizer(hf, src.config.vocab_size)
    if model_type in CONFIG_PATCH:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, **CONFIG_PATCH[model_type]}))
    script = tmp_path / "convert.py"
    script.write_text(CONVERT.format(src=str(LLAMA_CPP)))
    f32, out = tmp_path / "m-f32.gguf", tmp_path / f"m-{qtype}.gguf"
    subprocess.run([sys.executable, str(script), str(hf), "--outtype", "f32", "--outfile", str(f32)], check=True,
                   capture_output=True)
    if qtype is None:  # the converter's f32 file
        return src, hf, f32
    env = dict(os.environ, LD_LIBRARY_PATH=str(QUANTIZE.parent))
    subprocess.run([str(QUANTIZE), str(f32), str(out), qtype], check=True, capture_output=True, env=env)
    return src, hf, out


def check(ref, model) -> None:
    x = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        assert (model(x).logits - ref(x).logits).abs().max() < 1e-4
    assert torch.equal(model.generate(x, max_new_tokens=32, do_sample=False, eos_token_id=[]), want)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0"])
def test_qwen3_moe_against_transformers_gguf_loader(tmp_path, qtype):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    src, _, path = converted(tmp_path, "qwen3_moe", qtype)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=src.config,
                                               dtype=torch.float32).eval()
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.tokenizer is not None and model.tokenizer.decode(model.tokenizer.encode("ab c")) == "ab c"
    check(ref, model)
    model.close()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "glm4_moe", "minimax_m2"])
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q4_0"])
def test_families_against_the_dequantized_file(tmp_path, model_type, qtype):
    src, _, path = converted(tmp_path, model_type, qtype)
    ref = reference_from_file(src, path)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.family.name == model_type
    check(ref, model)
    model.close()


@pytest.mark.parametrize("checkpoint, qtype, kind", [("mxfp4", None, "mxfp4"), ("f32", "MXFP4_MOE", "mxfp4"),
                                                     ("f32", "Q8_0", "dense"), ("f32", "Q4_K_M", "dense"),
                                                     ("f32", "Q4_0", "awq"), ("f32", None, "dense")])
def test_gpt_oss_against_the_dequantized_file(tmp_path, checkpoint, qtype, kind):
    """gpt-oss: the converter repacks a published-layout MXFP4 checkpoint's blocks (``GptOssModel.repack_mxfp4``) or
    writes f32 experts, which llama-quantize makes MXFP4 (``MXFP4_MOE``), Q8_0, Q4_K_M or Q4_0."""
    from gguf_gpt_oss import fp16_biases
    from gguf_gpt_oss import reference_from_file as gpt_oss_reference
    from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

    src = make_gpt_oss_model(seed=5, intermediate_size=96, num_hidden_layers=3)
    if qtype == "Q4_0":  # Q4_0 experts run in the biased AWQ format, whose fp16 holds biases of ordinary size
        fp16_biases(src)
    hf = save_gpt_oss_checkpoint(src, tmp_path / "hf", mxfp4=checkpoint == "mxfp4")
    save_tokenizer(hf, src.config.vocab_size)
    script = tmp_path / "convert.py"
    script.write_text(CONVERT.format(src=str(LLAMA_CPP)))
    path = tmp_path / "m-f32.gguf"
    subprocess.run([sys.executable, str(script), str(hf), "--outtype", "f32", "--outfile", str(path)], check=True,
                   capture_output=True)
    if qtype is not None:
        out = tmp_path / f"m-{qtype}.gguf"
        env = dict(os.environ, LD_LIBRARY_PATH=str(QUANTIZE.parent))
        subprocess.run([str(QUANTIZE), str(path), str(out), qtype], check=True, capture_output=True, env=env)
        path = out
    ref = gpt_oss_reference(src, path)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.family.name == "gpt_oss" and model.experts.fmt.kind == kind
    assert model.family.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    check(ref, model)
    model.close()


@pytest.mark.parametrize("model_type, qtype, kind", [
    ("deepseek_v3", None, "dense"), ("deepseek_v3", "Q4_0", "awq"), ("deepseek_v3", "Q8_0", "gguf"),
    ("deepseek_v3", "Q4_K_M", "gguf"), ("deepseek_v2", None, "dense"), ("deepseek_v2", "Q4_K_M", "gguf"),
    ("glm4_moe_lite", "Q8_0", "gguf")])
def test_deepseek2_against_the_dequantized_file(tmp_path, model_type, qtype, kind):
    """deepseek2 as the converter writes it (kv_b_proj split into attn_k_b / attn_v_b, MLA as MQA, yarn_log_multiplier)
    and llama-quantize requantizes it; the f32 file against the transformers model itself. (llama.cpp takes a
    deepseek2 file for V2-Lite's single q_proj only at V2-Lite's layer counts, so the quantized V2 has a q LoRA.)"""
    from gguf_deepseek2 import reference_from_deepseek2_file

    lora = dict(q_lora_rank=64) if model_type == "deepseek_v2" and qtype is not None else {}
    src, _, path = converted(tmp_path, model_type, qtype, **lora)
    ref = src if qtype is None else reference_from_deepseek2_file(src, path)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == kind
    assert model.family.name == ("deepseek_v3" if model_type == "glm4_moe_lite" else model_type)
    assert model.family.config.num_hidden_layers == 3  # (GLM's MTP block counted in the file's block_count)
    check(ref, model)
    model.close()


COMPLETION = QUANTIZE.parent / "llama-completion"


@pytest.mark.skipif(not COMPLETION.is_file(), reason="no build/bin/llama-completion in MOEFLOW_LLAMA_CPP_DIR")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite"])
def test_deepseek2_greedy_tokens_equal_llama_cpp(tmp_path, model_type):
    """llama.cpp itself as the oracle: its greedy continuation (CPU, ``--ignore-eos``) of a prompt on the same file
    equals moeflow's (the end-of-generation tokens masked likewise), which checks the metadata's meaning (YaRN's
    mscale, groups, the sigmoid router, MLA's split kv_b, GLM's MTP layer in block_count) against llama.cpp's
    reading rather than transformers'. On the converter's f32 files: on quantized ones llama.cpp's CPU kernels
    quantize the activations to 8 bits (Q8_0 / Q8_K dot products), which moves these tiny models' near ties (Q8_0:
    after one equal token here; Q4_0, Q4_K_M: after 7 to 11)."""
    _, _, path = converted(tmp_path, model_type, None)
    prompt, new = "abc def!#", 24
    env = dict(os.environ, LD_LIBRARY_PATH=str(QUANTIZE.parent))
    run = subprocess.run([str(COMPLETION), "-m", str(path), "-p", prompt, "-n", str(new), "--temp", "0", "-no-cnv",
                          "--no-warmup", "--simple-io", "-dev", "none", "--ignore-eos", "-sp", "-t", "2"],
                         check=True, capture_output=True, text=True, env=env)
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    try:
        ids = torch.tensor([model.tokenizer.encode(prompt, add_special_tokens=False)])
        eog = [model.tokenizer.encode(t, add_special_tokens=False) for t in ("<|endoftext|>", "<|im_end|>")]
        assert all(len(t) == 1 for t in eog)  # (each one special token)
        eog = [t[0] for t in eog]
        with torch.no_grad():
            for _ in range(new):
                logits = model(ids).logits[0, -1].clone()
                logits[eog] = float("-inf")
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        text = model.tokenizer.decode(ids[0, : -new // 3])  # (llama.cpp's last bytes may be cut at exit)
    finally:
        model.close()
    assert len(text) > len(prompt) + 8 and run.stdout.strip().startswith(text), (run.stdout, text)
