"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture, written here with gguf-py as its converter lays them
out: tests/gguf_gpt_oss.py) loaded by ``from_pretrained``: the config from the metadata (sliding window and pattern,
YaRN, experts), the attention sinks and biases, MXFP4 experts into the MXFP4 format as stored (float experts into
the biased dense format); greedy tokens equal transformers' on the same dequantized weights (fp32, kernels="torch"),
offloaded (lru, two slot counts; the disk tier reading the GGUF) equal to resident; the MXFP4 Triton kernels
(interpreted) on the GGUF's experts; Q4_0 experts (a requantized file) in the biased AWQ format, on the torch path
and its Triton kernels (interpreted). ~18 s on 2 cores (load 3; 11 s of it the interpreted kernels)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf_gpt_oss import T, fp16_biases, write_gpt_oss_gguf  # noqa: E402
from gpt_oss_helpers import make_gpt_oss_model  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.engine.loading import mxfp4_expert_tensors  # noqa: E402
from moeflow.errors import CheckpointError  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402
from moeflow.io.gguf.biased import BiasedConvert, ExpertBiases  # noqa: E402
from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4  # noqa: E402

NEW_TOKENS = 16
SHAPE = dict(intermediate_size=96, num_hidden_layers=3)  # I != H: a transposed expert matrix cannot pass


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the rebuilt tokenizers


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))


def generate(model) -> torch.Tensor:
    return model.generate(ids(), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])


@pytest.mark.parametrize("expert_type, kind", [(T.MXFP4, "mxfp4"), (T.F16, "dense")])
def test_gpt_oss_gguf_matches_transformers(tmp_path, expert_type, kind):
    ref = make_gpt_oss_model(seed=2, **SHAPE)
    write_gpt_oss_gguf(ref, tmp_path / "m.gguf", expert_type=expert_type)  # ref now holds the file's values
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    try:
        cfg = model.family.config
        assert model.family.name == "gpt_oss" and model.experts.fmt.kind == kind
        assert (cfg.intermediate_size, cfg.sliding_window, cfg.swiglu_limit) == (96, 4, 7.0)
        assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
        assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 32.0 and not cfg.rope["truncate"]
        x = ids()
        with torch.no_grad():
            want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
            assert (model(x).logits - ref(x).logits).abs().max() < 1e-4
        assert torch.equal(generate(model), want)
    finally:
        model.close()


def test_gpt_oss_gguf_tokenizer_or_a_warning_where_transformers_cannot_rebuild_it(tmp_path, caplog):
    """transformers >= 5.24 rebuilds a gpt-oss file's byte-level BPE tokenizer; older ones have no converter for
    the architecture (5.17, the lent GPU machine's: its reader also fails on the file's YaRN fields under numpy
    2.5): the model loads without a tokenizer and a warning names transformers' version, as without transformers."""
    write_gpt_oss_gguf(make_gpt_oss_model(seed=4, **SHAPE), tmp_path / "m.gguf")
    with caplog.at_level("WARNING", logger="moeflow.io.gguf.tokenizer"):
        model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    try:
        try:
            from transformers.integrations.gguf import convert_gguf_tokenizer  # noqa: F401  (5.24+, as moeflow)
        except ImportError:
            import transformers

            assert model.tokenizer is None
            assert f"transformers {transformers.__version__} cannot rebuild the tokenizer" in caplog.text
            assert "'gpt-oss'" in caplog.text and "m.gguf" in caplog.text
        else:
            assert model.tokenizer is not None and model.tokenizer.vocab_size == 97
            assert model.tokenizer.decode(model.tokenizer.encode("ab", add_special_tokens=False)) == "ab"
    finally:
        model.close()


def test_gpt_oss_gguf_offloaded_matches_resident(tmp_path):
    write_gpt_oss_gguf(make_gpt_oss_model(seed=4, **SHAPE), tmp_path / "m.gguf")
    resident = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    want = generate(resident)
    resident.close()
    for slots in (2, 3):
        model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch",
                                         offload=OffloadConfig(policy="lru", gpu_expert_slots=slots,
                                                               transport="random-delay", random_delay_ms=0.3))
        try:
            assert model.experts.fmt.kind == "mxfp4"
            assert torch.equal(generate(model), want), f"lru with {slots} slots"
            s = model.stats
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0  # experts did move from the host copy
        finally:
            model.close()


def test_disk_tier_reads_gpt_oss_experts_from_the_gguf(tmp_path):
    from moeflow.engine.loading import non_expert_bytes
    from moeflow.engine.memory import kv_cache_bytes

    write_gpt_oss_gguf(make_gpt_oss_model(seed=4, **SHAPE), tmp_path / "m.gguf")
    resident = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    want = generate(resident)
    row = resident.experts.fmt.nbytes
    staging = open_gguf(tmp_path / "m.gguf").expert_source((0, 1, 2), 4, 64, 96).staging_nbytes
    reserved = non_expert_bytes(resident.model) + kv_cache_bytes(resident.family.config, torch.float32, 4096)
    resident.close()
    budget = (reserved + 2 * staging + 5 * row + row // 2) / 2**30  # 5 of the 12 experts in host memory
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch", offload=OffloadConfig(
        policy="lru", gpu_expert_slots=3, host_memory_gb=budget, disk_readers=2))
    try:
        assert model.experts.host.on_disk and model.experts.fmt.kind == "mxfp4"
        assert torch.equal(generate(model), want)
        assert model.experts.host.stats.bytes_read > 0
    finally:
        model.close()


def test_mxfp4_experts_are_the_published_blocks_and_the_files_biases(tmp_path):
    """An expert as the source reads it: the blocks dequantize to gguf-py's values of the file, the biases are the
    file's, gate rows first."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    src = make_gpt_oss_model(seed=5, **SHAPE)
    write_gpt_oss_gguf(src, tmp_path / "m.gguf")
    gguf = open_gguf(tmp_path / "m.gguf")
    convert = BiasedConvert(mxfp4_expert_tensors, ExpertBiases(gguf.files, 96, 64))
    source = gguf.expert_source((0, 1, 2), 4, 64, 96, convert)
    try:
        raw = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
        t = source.read(2, 3, source.new_staging())
        gate = dequantize(raw["blk.2.ffn_gate_exps.weight"].data, T.MXFP4)[3]
        up = dequantize(raw["blk.2.ffn_up_exps.weight"].data, T.MXFP4)[3]
        down = dequantize(raw["blk.2.ffn_down_exps.weight"].data, T.MXFP4)[3]
        assert torch.equal(dequantize_mxfp4(t["w13_blocks"], t["w13_scales"]),
                           torch.from_numpy(np.concatenate([gate, up])))
        assert torch.equal(dequantize_mxfp4(t["w2_blocks"], t["w2_scales"]), torch.from_numpy(down))
        bias = src.model.layers[2].mlp.experts.gate_up_proj_bias[3].detach()
        assert torch.equal(t["w13_bias"], torch.cat([bias[0::2], bias[1::2]]))
        assert torch.equal(t["w2_bias"], src.model.layers[2].mlp.experts.down_proj_bias[3].detach())
    finally:
        source.close()


@pytest.mark.parametrize(("expert_type", "reason"), [
    ("Q8_0", "dequantized"),  # quantized float experts: no biased GGUF form
    ("Q4_0", "fp16"),  # Q4_0 experts whose biases the biased AWQ format's fp16 cannot hold
])
def test_experts_without_a_biased_form_are_dequantized_with_a_warning(tmp_path, expert_type, reason):
    write_gpt_oss_gguf(make_gpt_oss_model(seed=6, **SHAPE), tmp_path / "m.gguf", expert_type=getattr(T, expert_type))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")
    model.close()
    assert model.experts.fmt.kind == "dense"
    assert any(expert_type in str(w.message) and reason in str(w.message) for w in caught)


def test_q4_0_experts_run_as_stored_in_the_biased_awq_format(tmp_path):
    """A requantized gpt-oss file with Q4_0 experts: the biased AWQ format (Q4_0's codes and scales, the file's
    biases), transformers' tokens on the dequantized weights, resident and offloaded (lru, 2 and 3 slots)."""
    ref = fp16_biases(make_gpt_oss_model(seed=9, **SHAPE))
    write_gpt_oss_gguf(ref, tmp_path / "m.gguf", expert_type=T.Q4_0)
    x = ids()
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    for slots in (None, 2, 3):
        offload = None if slots is None else OffloadConfig(policy="lru", gpu_expert_slots=slots,
                                                           transport="random-delay", random_delay_ms=0.3)
        model = MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch", offload=offload)
        try:
            assert model.experts.fmt.kind == "awq" and model.experts.fmt.bias
            if slots is None:
                with torch.no_grad():
                    assert (model(x).logits - ref(x).logits).abs().max() < 1e-4
            assert torch.equal(generate(model), want), f"{slots} slots"
        finally:
            model.close()


def test_gpt_oss_gguf_without_sinks_is_refused(tmp_path):
    write_gpt_oss_gguf(make_gpt_oss_model(seed=6, **SHAPE), tmp_path / "m.gguf", leave_out="attn_sinks")
    with pytest.raises(CheckpointError, match=r"m\.gguf.*blk\.0\.attn_sinks\.weight"):
        MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")


def test_gpt_oss_gguf_with_linear_rope_scaling_is_refused(tmp_path, monkeypatch):
    import gguf

    add = gguf.GGUFWriter.add_rope_scaling_type
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_type",
                        lambda self, _kind: add(self, gguf.RopeScalingType.LINEAR))
    write_gpt_oss_gguf(make_gpt_oss_model(seed=6, **SHAPE), tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=r"m\.gguf: rope scaling 'linear' \(gpt-oss\.rope\.scaling\.type\)"):
        MoEModel.from_pretrained(tmp_path / "m.gguf", dtype=torch.float32, kernels="torch")


def test_gpt_oss_gguf_through_the_mxfp4_triton_kernels(tmp_path):
    """The GGUF's MXFP4 experts through the MXFP4 Triton kernels (interpreted on the CPU): transformers' tokens."""
    ref = make_gpt_oss_model(seed=8, **SHAPE)
    write_gpt_oss_gguf(ref, tmp_path / "m.gguf")
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", device="cpu", dtype=torch.float32, kernels="triton")
    x = ids()[:1]
    try:
        assert model.experts.fmt.kind == "mxfp4"
        with torch.no_grad():
            want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        assert torch.equal(model.generate(x, max_new_tokens=10, do_sample=False, eos_token_id=[]), want)
    finally:
        model.close()


def test_q4_0_experts_through_the_biased_awq_triton_kernels(tmp_path):
    """The GGUF's Q4_0 experts in the biased AWQ format through its Triton kernels (interpreted on the CPU): the bias
    and clamped-SwiGLU epilogue on Q4_0's codes give transformers' tokens."""
    ref = fp16_biases(make_gpt_oss_model(seed=10, **SHAPE))
    write_gpt_oss_gguf(ref, tmp_path / "m.gguf", expert_type=T.Q4_0)
    model = MoEModel.from_pretrained(tmp_path / "m.gguf", device="cpu", dtype=torch.float32, kernels="triton")
    x = ids()[:1]
    try:
        assert model.experts.fmt.kind == "awq" and model.experts.fmt.has_triton
        with torch.no_grad():
            want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        assert torch.equal(model.generate(x, max_new_tokens=10, do_sample=False, eos_token_id=[]), want)
    finally:
        model.close()
