"""GGUF models (llama.cpp's layout, written here with gguf-py from the tests' tiny transformers models) loaded by
``from_pretrained``: greedy tokens equal transformers' on the same dequantized weights (fp32): Qwen3-MoE against
transformers' own GGUF loader, Mixtral (``llama`` with experts, q/k rows permuted, a split set) and K-quant / MXFP4
experts against the model holding gguf-py's dequantization; the expert byte ranges; the tokenizer and chat template
from the metadata; the disk tier reading experts from the GGUF. ~25 s on 2 cores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from family_models import make_family_model  # noqa: E402
from gguf_models import T, random_k_experts, reference_model, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.engine.gguf_experts import q4_0_awq_expert_tensors  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402

NEW_TOKENS = 20


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the rebuilt tokenizers


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))


def same_tokens(ref, model, vocab: int) -> torch.Tensor:
    x = ids(vocab)
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    got = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    assert torch.equal(got, want)
    with torch.no_grad():
        assert (model(x).logits - ref(x).logits).abs().max() < 1e-4
    return got


def test_qwen3_moe_gguf_matches_transformers_own_gguf_loader(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    src = make_family_model("qwen3_moe", seed=1, norm_topk_prob=True)  # llama.cpp's qwen3moe renormalises
    write_gguf(src, tmp_path / "m.gguf", expert_types=T.Q8_0, other_type=T.F16)
    # transformers 5.24 maps no expert_feed_forward_length for qwen3moe (moe_intermediate_size would be its default):
    # the config is given, the tensors are transformers' own reading and dequantization of the file
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", config=src.config,
                                               dtype=torch.float32).eval()
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    assert model.family.name == "qwen3_moe" and model.kernels == "torch"
    assert model.config.moe_intermediate_size == 32 and model.config.norm_topk_prob
    same_tokens(ref, model, 97)
    model.close()


def test_mixtral_split_gguf_unpermutes_q_and_k(tmp_path):
    ref = make_tiny_model(seed=2)
    written = write_gguf(ref, tmp_path / "mx-00001-of-00003.gguf", expert_types=[T.Q4_0, T.Q8_0],
                         other_type=T.Q8_0, split=3)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path, dtype=torch.float32, kernels="torch")  # the directory's split set
    assert model.family.name == "mixtral" and model.config.num_local_experts == 6
    same_tokens(ref, model, 97)
    model.close()


@pytest.mark.parametrize("model_type,overrides", [("qwen2_moe", {}), ("olmoe", {})])
def test_qwen2_moe_and_olmoe_ggufs(tmp_path, model_type, overrides):
    ref = make_family_model(model_type, seed=4, **overrides)
    written = write_gguf(ref, tmp_path / "m.gguf", expert_types=T.Q4_0, other_type=T.Q8_0)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    assert model.family.name == model_type
    same_tokens(ref, model, 97)
    model.close()


@pytest.mark.parametrize("name", ["qk-norm-bias-groups", "plain-unnormalised"])
def test_glm4_moe_gguf(tmp_path, name):
    from tiny_families import GLM4_MOE, make_model

    # llama.cpp's glm4moe routes without groups (sigmoid, selection bias, shared experts, leading dense layers)
    ref = make_model("glm4_moe", seed=5, **{**GLM4_MOE[name], "n_group": 1, "topk_group": 1})
    written = write_gguf(ref, tmp_path / "m.gguf", expert_types=T.Q8_0, other_type=T.Q8_0)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    assert model.family.name == "glm4_moe"
    head_dim = getattr(ref.config, "head_dim", None) or 64 // ref.config.num_attention_heads
    assert model.config.rotary_dim == head_dim * ref.config.rope_parameters["partial_rotary_factor"]
    same_tokens(ref, model, 97)
    model.close()


@pytest.mark.parametrize("name", ["qk-norm-partial-rotary", "no-qk-norm-no-bias-full-rotary"])
def test_minimax_m2_gguf(tmp_path, name):
    from tiny_families import MINIMAX_M2, make_model

    ref = make_model("minimax_m2", seed=5, **MINIMAX_M2[name])
    written = write_gguf(ref, tmp_path / "m.gguf", expert_types=T.Q8_0, other_type=T.Q8_0)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    assert model.family.name == "minimax_m2"
    same_tokens(ref, model, 97)
    model.close()


def test_k_quant_and_mxfp4_experts(tmp_path):
    ref = make_family_model("qwen3_moe", seed=3, norm_topk_prob=True, hidden_size=256, moe_intermediate_size=256,
                            num_hidden_layers=3, head_dim=32)
    E, H, I = 8, 256, 256  # noqa: E741
    raw = {}
    for layer, kinds in enumerate((("Q4_K", "Q5_K", "Q6_K"), ("Q6_K", "Q4_K", "Q5_K"), ("MXFP4", "MXFP4", "Q4_K"))):
        for seed, (proj, kind) in enumerate(zip(("gate", "up", "down"), kinds, strict=True)):
            raw[(layer, proj)] = (random_k_experts(kind, E, H if proj == "down" else I, seed + 3 * layer),
                                  getattr(T, kind))
    written = write_gguf(ref, tmp_path / "k.gguf", other_type=T.Q8_0, raw_experts=raw)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path / "k.gguf", dtype=torch.float32, kernels="torch")
    same_tokens(ref, model, 97)
    model.close()


def test_q4_0_experts_become_awq_bit_for_bit(tmp_path):
    from gguf.quants import dequantize as gguf_dequantize

    from moeflow.quant.awq import unpack_int4

    def awq_fp32(qweight, qzeros, scales):  # W [N, K] = (q - z) * s in fp32, as the reference kernels compute it
        z = unpack_int4(qzeros).repeat_interleave(32, dim=0)
        return ((unpack_int4(qweight) - z).float() * scales.float().repeat_interleave(32, dim=0)).T

    ref = make_family_model("qwen3_moe", seed=6, norm_topk_prob=True)
    written = write_gguf(ref, tmp_path / "m.gguf", expert_types=T.Q4_0, other_type=T.F16)
    reference_model(ref, written)
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    fmt = model.experts.fmt
    assert (fmt.kind, fmt.group_size, fmt.dtype) == ("awq", 32, torch.float16)
    source = open_gguf(tmp_path / "m.gguf").expert_source((0, 1), 8, 64, 32, convert=q4_0_awq_expert_tensors)
    staging = source.new_staging()
    for layer, e in ((0, 0), (1, 7)):
        t, raw = source.read(layer, e, staging), {}
        for p in ("gate", "up", "down"):
            raw[p] = gguf_dequantize(source.read_raw(layer, e, staging)[p].numpy(), T.Q4_0)
        w13 = awq_fp32(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"])
        w2 = awq_fp32(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"])
        assert t["w13_scales"].dtype == torch.float16 and bool((unpack_int4(t["w2_qzeros"]) == 8).all())
        assert torch.equal(w2, torch.from_numpy(raw["down"]))  # fp32 (q - 8) * d, as ggml computes it
        assert torch.equal(w13, torch.from_numpy(np.concatenate([raw["gate"], raw["up"]])))
    same_tokens(ref, model, 97)
    model.close()


def test_expert_source_gives_each_experts_bytes_as_stored(tmp_path):
    import gguf

    src = make_family_model("qwen3_moe", seed=1, norm_topk_prob=True)
    write_gguf(src, tmp_path / "m.gguf", expert_types=[T.Q4_0, T.Q8_0])
    model = open_gguf(tmp_path / "m.gguf")
    source = model.expert_source((0, 1), 8, 64, 32)
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert source.types() == {"gate": {"Q4_0", "Q8_0"}, "up": {"Q4_0", "Q8_0"}, "down": {"Q4_0", "Q8_0"}}
    staging = source.new_staging()
    file = (tmp_path / "m.gguf").read_bytes()
    for layer in (0, 1):
        for e in (0, 5, 7):
            x = source.expert(layer, e)
            raw = source.read_raw(layer, e, staging)
            for proj, s in x.slices.items():
                t = stored[f"blk.{layer}.ffn_{proj}_exps.weight"]
                assert s.tensor == t.name and s.type.name == t.tensor_type.name
                assert s.shape == ((32, 64) if proj != "down" else (64, 32))
                assert s.nbytes * 8 == t.n_bytes and s.offset == t.data_offset + e * s.nbytes  # contiguous rows
                assert np.array_equal(raw[proj].numpy(), np.asarray(t.data[e]))
                assert file[s.offset:s.offset + s.nbytes] == raw[proj].numpy().tobytes()
            tensors = source.read(layer, e, staging)  # the interim dense format's tensors
            assert tuple(tensors["w13"].shape) == (64, 64) and tuple(tensors["w2"].shape) == (64, 32)
    assert source.reads == 12 and source.bytes_read == 6 * sum(x.nbytes for x in (source.expert(0, 0),)) + \
        6 * source.expert(1, 0).nbytes
    source.close()


def test_tokenizer_and_chat_template_from_the_metadata(tmp_path):
    src = make_family_model("qwen3_moe", seed=1, norm_topk_prob=True)
    write_gguf(src, tmp_path / "m.gguf")
    model = MoEModel.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    tok = model.tokenizer
    assert tok is not None and tok.vocab_size == 97
    ids_ = tok.encode("ab cab", add_special_tokens=False)
    assert tok.decode(ids_) == "ab cab" and ids_.count(tok.token_id("ab")) == 2  # the merge "a b" applied
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.generation_config.eos_ids() == [96]  # tokenizer.ggml.eos_token_id
    model.close()


def test_disk_tier_reads_experts_from_the_gguf(tmp_path):
    from moeflow.engine.loading import non_expert_bytes
    from moeflow.engine.memory import kv_cache_bytes

    src = make_family_model("qwen3_moe", seed=1, norm_topk_prob=True)
    write_gguf(src, tmp_path / "m.gguf", expert_types=T.Q4_0, other_type=T.F16)
    resident = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    x = ids(97)
    want = resident.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    row = resident.experts.fmt.nbytes
    gguf = open_gguf(tmp_path / "m.gguf")
    staging = gguf.expert_source((0, 1), 8, 64, 32).staging_nbytes
    reserved = non_expert_bytes(resident.model) + kv_cache_bytes(resident.family.config, torch.float32, 4096)
    resident.close()
    budget = (reserved + 2 * staging + 5 * row + row // 2) / 2**30  # 5 of the 16 experts in host memory
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch", offload=OffloadConfig(
        policy="lru", gpu_expert_slots=4, host_memory_gb=budget, disk_readers=2))
    try:
        assert model.experts.host.on_disk
        assert torch.equal(model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[]), want)
        assert model.experts.host.stats.bytes_read > 0
    finally:
        model.close()


def test_the_peer_benchmarks_q4_0_gguf_runs_as_its_awq_checkpoint(tmp_path):
    """benchmarks/common/gguf_checkpoint.py writes the synthetic AWQ checkpoint's weights as a Q4_0 GGUF (what llama.cpp
    runs beside moeflow): loaded here, the experts are AWQ again (the same codes and scales) and the attention is the
    AWQ linears' values, so both forms give the same logits, bit for bit, and the same tokens."""
    from benchmarks.common import gguf_checkpoint
    from benchmarks.common.checkpoint import TINY, write_synthetic_awq_checkpoint

    cfg = {**TINY, "num_hidden_layers": 3}
    write_synthetic_awq_checkpoint(tmp_path / "awq", cfg, group_size=32)
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "m.gguf", "mixtral", cfg, group=32)
    awq = MoEModel.from_pretrained(tmp_path / "awq", kernels="torch")
    model = MoEModel.from_pretrained(path, kernels="torch")
    assert model.experts.fmt == awq.experts.fmt
    x = torch.randint(0, cfg["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x).logits, awq(x).logits)
    want = awq.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    assert torch.equal(model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[]), want)
    awq.close()
    model.close()


def test_sentencepiece_merges_are_the_ones_transformers_5_17_derives():
    """A SentencePiece GGUF stores no merges; transformers 5.17 derives them in a loop quadratic in the vocabulary
    (minutes at the GPU loan's 32k tokens), moeflow's rebuild hands it the same list made with a set."""
    from moeflow.io.gguf.tokenizer import sentencepiece_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "ca"]
    scores = [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0]
    merges = sentencepiece_merges(tokens, scores)
    # by the token's score; a token's splits by their halves' scores ("abc": a|bc before ab|c, "▁ab": ▁|ab first)
    assert merges == ["a b", "b c", "a bc", "ab c", "\u2581 a", "\u2581 ab", "\u2581a b", "c a"]
    assert sentencepiece_merges(["a", "b", "a b"], [0.0, -1.0, -2.0]) is None  # "a b" would not split back
    try:  # transformers < 5.24: its own derivation gives the same pairs
        from transformers.integrations.ggml import GGUFTokenizerSkeleton
    except ImportError:
        return
    assert GGUFTokenizerSkeleton({"tokens": tokens, "scores": scores}).merges == [tuple(m.split(" ")) for m in merges]


def test_the_tokenizer_converter_transformers_before_5_24_has_for_an_architecture():
    """transformers < 5.24 keys its GGUF tokenizer converters by architecture (5.17, the lent GPU machine's: none for
    gpt-oss or DeepSeek-V2/V3); moeflow looks the file up first and, without one, loads the model without a
    tokenizer (test_gguf_gpt_oss.py) instead of refusing it. 5.17's table, as it names the architectures:"""
    from moeflow.io.gguf.tokenizer import converter_name

    table = {"llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_5_text", "phi3", "bloom", "falcon", "stablelm",
             "gpt2", "starcoder2", "t5", "mamba", "nemotron", "gemma2", "gemma3_text", "gemma4_text", "umt5", "deci",
             "decilm", "minimax_m2"}
    assert converter_name("llama", "mixtral", table) == "llama"  # Mixtral's files are llama.cpp's "llama"
    assert converter_name("qwen3moe", "qwen3_moe", table) == "qwen3_moe"
    assert converter_name("minimax-m2", "minimax_m2", table) == "minimax_m2"
    assert converter_name("gpt-oss", "gpt_oss", table) is None
    assert converter_name("deepseek2", "deepseek_v3", table) is None
    assert converter_name("gpt-oss", "gpt_oss", table | {"gpt_oss"}) == "gpt_oss"
