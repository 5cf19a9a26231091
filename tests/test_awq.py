"""The AWQ 4-bit GEMM format: packing order, dequantization, RTN quantizer, checkpoint conversion."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_checkpoint, make_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from moeflow import MoEOffloadedMixtral
from moeflow.quant.awq import dequantize, pack_int4, quantize_rtn, unpack_int4
from moeflow.tools.quantize import quantize_checkpoint


def spec_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The published layout, written out literally: nibble i of word c holds column 8c + [0,2,4,6,1,3,5,7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, words = packed.shape
    out = torch.empty(rows, words * 8, dtype=torch.int64)
    for r in range(rows):
        for c in range(words):
            word = int(packed[r, c]) & 0xFFFFFFFF
            for i in range(8):
                out[r, 8 * c + order[i]] = (word >> (4 * i)) & 0xF
    return out


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), words=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_pack_follows_published_nibble_order_and_round_trips(rows, words, seed):
    q = torch.randint(0, 16, (rows, words * 8), generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert torch.equal(spec_unpack(packed), q.long())
    assert torch.equal(unpack_int4(packed), q.int())


def test_known_word():
    # columns 0..7 hold 1..8: nibbles in order [0,2,4,6,1,3,5,7] -> 1,3,5,7,2,4,6,8 from the low end
    q = torch.arange(1, 9).reshape(1, 8)
    assert int(pack_int4(q)[0, 0]) & 0xFFFFFFFF == 0x86427531


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_formula(group):
    k, n = 2 * group, 16
    g = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    s = torch.rand(k // group, n, generator=g).half() + 0.01
    w = dequantize(pack_int4(q), pack_int4(z), s, group)
    want = (q - z.repeat_interleave(group, 0)).half() * s.repeat_interleave(group, 0)
    assert torch.equal(w, want)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_error_within_half_step(group):
    w = torch.randn(24, 2 * group, generator=torch.Generator().manual_seed(0))
    t = quantize_rtn(w, group)
    assert t.qweight.shape == (2 * group, 3) and t.scales.shape == (2, 24) and t.qzeros.shape == (2, 3)
    back = dequantize(t.qweight, t.qzeros, t.scales.float(), group).T
    step = t.scales.float().repeat_interleave(group, 0).T
    # half a step of rounding, plus the zero point's own rounding (another half step at most)
    assert bool(((back - w).abs() <= step * 1.0 + 1e-6).all())


def test_rtn_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(torch.randn(8, 64), 48)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_rtn(torch.randn(12, 64), 32)


def dequantized_reference(awq_dir, config_overrides, group):
    """A transformers model carrying exactly the weights the AWQ checkpoint holds (experts dequantized)."""
    sd = load_file(awq_dir / "model.safetensors")
    ref = make_tiny_model(seed=0, **config_overrides)
    cfg = ref.config
    state = {}
    for name, t in sd.items():
        if name.endswith((".qweight", ".qzeros", ".scales")):
            continue
        state[name] = t.float()
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_local_experts):
            for w in ("w1", "w2", "w3"):
                base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                state[f"{base}.weight"] = dequantize(
                    sd[f"{base}.qweight"], sd[f"{base}.qzeros"], sd[f"{base}.scales"].float(), group).T
    # transformers 5 keeps experts fused in memory; build that from the per-expert weights
    for layer in range(cfg.num_hidden_layers):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        es = range(cfg.num_local_experts)
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{base}.{e}.w1.weight"], state[f"{base}.{e}.w3.weight"]]) for e in es])
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([state[f"{base}.{e}.w2.weight"] for e in es])
        state[f"model.layers.{layer}.mlp.gate.weight"] = state.pop(f"model.layers.{layer}.block_sparse_moe.gate.weight")
    state = {k: v for k, v in state.items() if ".block_sparse_moe.experts." not in k}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return ref.eval()


@pytest.mark.parametrize("group,overrides", [(32, {}), (64, dict(hidden_size=128, intermediate_size=192))])
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, group, overrides):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=0, **overrides)
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=group, progress=False)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc == {"bits": 4, "group_size": group, "modules_to_not_convert": ["gate"], "quant_method": "awq",
                  "version": "gemm", "zero_point": True}
    names = load_file(dst / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.0.w1.qweight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names  # attention stays 16-bit
    model = MoEOffloadedMixtral.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    ref = dequantized_reference(dst, overrides, group)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got = model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=24, eos_token_id=[]), want_tokens)


def test_awq_tensors_round_trip_through_checkpoint(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=3)
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=32, progress=False)
    sd_src = load_file(src / "model.safetensors")
    sd = load_file(dst / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w3"
    t = quantize_rtn(sd_src[f"{name}.weight"], 32)
    assert torch.equal(sd[f"{name}.qweight"], t.qweight)
    assert torch.equal(unpack_int4(sd[f"{name}.qweight"]), unpack_int4(t.qweight))
    assert torch.equal(sd[f"{name}.qzeros"], t.qzeros) and torch.equal(sd[f"{name}.scales"], t.scales)


def test_awq_attention_and_old_quant_config(tmp_path):
    """Published Mixtral AWQ checkpoints quantize attention too; older ones carry quant_config.json."""
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=4)
    both = quantize_checkpoint(src, tmp_path / "awq-attn", group_size=32, quantize_attention=True, progress=False)
    assert "model.layers.0.self_attn.q_proj.qweight" in load_file(both / "model.safetensors")
    model = MoEOffloadedMixtral.from_pretrained(both, kernels="torch")
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = model(ids).logits
    # old-style: quantization described by quant_config.json instead of config.json
    cfg = json.loads((both / "config.json").read_text())
    del cfg["quantization_config"]
    (both / "config.json").write_text(json.dumps(cfg))
    (both / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                         "version": "GEMM"}))
    assert torch.equal(MoEOffloadedMixtral.from_pretrained(both, kernels="torch")(ids).logits, logits)


def test_quantize_leaves_nothing_behind_on_failure(tmp_path, monkeypatch):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=5)
    import moeflow.tools.quantize as convert

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(convert, "_write_shards", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        quantize_checkpoint(src, tmp_path / "out", group_size=32, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32"]
