"""DeepSeek-V3's FP8 weights as published (e4m3, block scales ``weight_scale_inv``): read, dequantized, experts
requantized to int4 at load and by ``moeflow quantize``; logits against transformers on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_families import DEEPSEEK_V3, assert_matches_transformers, make_model, write_fp8_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.errors import CheckpointError
from moeflow.quant.awq import dequantize
from moeflow.quant.fp8 import awq_expert_tensors, dequantize_fp8_block, quantize_fp8_block
from moeflow.tools.quantize import quantize_checkpoint

pytest.importorskip("transformers")
BLOCK = (16, 16)  # DeepSeek-V3 uses 128 x 128; 16 x 16 gives these tiny weights several blocks and ragged edges
CONFIG = DEEPSEEK_V3["qlora-groups-dense"]


def test_block_dequantization_is_per_block():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    q, scale_inv = quantize_fp8_block(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 5)
    back = dequantize_fp8_block(q, scale_inv, BLOCK)
    assert torch.equal(back[17:32, 48:64], q[17:32, 48:64].float() * scale_inv[1, 3])
    assert torch.equal(back[32:, 64:], q[32:, 64:].float() * scale_inv[2, 4])  # the ragged corner block
    assert float((back - w).abs().max() / w.abs().max()) < 1 / 16  # e4m3 keeps 3 mantissa bits
    with pytest.raises(ValueError, match="needs"):
        dequantize_fp8_block(q, scale_inv[:2], BLOCK)


def fp8_target(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 publishes in FP8: every 2-D linear weight of the decoder layers but the router."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2 \
        and not name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(FP8 checkpoint dir, the transformers model, the weights the FP8 tensors stand for)."""
    root = tmp_path_factory.mktemp("fp8")
    ref = make_model("deepseek_v3", seed=4, **CONFIG)
    ref.save_pretrained(root / "src")
    config = json.loads((root / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    dst = root / "fp8"
    effective = write_fp8_checkpoint(root / "src", dst, config, BLOCK, fp8_target)
    return dst, ref, effective


def reference_on(ref, effective: dict[str, torch.Tensor], group: int):
    """The transformers model carrying ``effective`` weights, experts requantized to int4 and dequantized."""
    cfg = ref.config
    state = {k: v for k, v in effective.items() if ".mlp.experts." not in k}
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        gate_up, down = [], []
        for e in range(cfg.n_routed_experts):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            w13 = torch.cat([effective[f"{base}.gate_proj.weight"], effective[f"{base}.up_proj.weight"]])
            awq = awq_expert_tensors(w13, effective[f"{base}.down_proj.weight"], group)
            gate_up.append(dequantize(awq["w13_qweight"], awq["w13_qzeros"], awq["w13_scales"].float(), group).T)
            down.append(dequantize(awq["w2_qweight"], awq["w2_qzeros"], awq["w2_scales"].float(), group).T)
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return ref.eval()


def test_fp8_checkpoint_loads_and_matches_transformers(fp8_checkpoint):
    path, ref, effective = fp8_checkpoint
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq" and model.experts.fmt.group_size == 32
    ref = reference_on(ref, effective, 32)
    assert_matches_transformers(model, ref)


def test_moeflow_quantize_converts_fp8(fp8_checkpoint, tmp_path):
    path, _, effective = fp8_checkpoint
    dst = quantize_checkpoint(path, tmp_path / "awq", group_size=32, progress=False)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    sd = load_file(dst / "model.safetensors")
    assert not any(n.endswith("_scale_inv") for n in sd)
    assert all(t.dtype in (torch.float16, torch.int32, torch.float32) for t in sd.values())
    base = "model.layers.1.mlp.experts.3"
    w13 = torch.cat([effective[f"{base}.gate_proj.weight"], effective[f"{base}.up_proj.weight"]])
    want = awq_expert_tensors(w13, effective[f"{base}.down_proj.weight"], 32)
    got_q = torch.cat([sd[f"{base}.gate_proj.qweight"], sd[f"{base}.up_proj.qweight"]], dim=1)
    assert torch.equal(got_q, want["w13_qweight"]) and torch.equal(sd[f"{base}.down_proj.qweight"], want["w2_qweight"])
    assert torch.allclose(sd["model.layers.0.self_attn.kv_b_proj.weight"].float(),
                          effective["model.layers.0.self_attn.kv_b_proj.weight"], rtol=1e-3, atol=1e-4)
    fp8_tokens = MoEModel.from_pretrained(path, kernels="torch").generate(
        torch.arange(5)[None] + 7, max_new_tokens=12, do_sample=False, eos_token_id=[])
    awq_tokens = MoEModel.from_pretrained(dst, kernels="torch").generate(
        torch.arange(5)[None] + 7, max_new_tokens=12, do_sample=False, eos_token_id=[])
    assert torch.equal(fp8_tokens, awq_tokens)


def test_fp8_without_scales_names_the_tensor(fp8_checkpoint, tmp_path):
    path, *_ = fp8_checkpoint
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.0.self_attn.q_a_proj.weight_scale_inv"]
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight' is FP8.*"
                                              r"weight_scale_inv' are missing"):
        MoEModel.from_pretrained(tmp_path)


def test_group_count_not_dividing_the_experts_names_the_field(tmp_path):
    ref = make_model("deepseek_v3", **CONFIG)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_group"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="n_group=3 does not divide n_routed_experts=8"):
        MoEModel.from_pretrained(tmp_path)


def test_mtp_layer_is_never_read_and_an_mtp_only_shard_is_named(tmp_path):
    ref = make_model("deepseek_v3", **CONFIG)
    ref.save_pretrained(tmp_path / "src")
    sd = load_file(tmp_path / "src" / "model.safetensors")
    n = ref.config.num_hidden_layers
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v for k, v in sd.items()
           if k.startswith(f"model.layers.{n - 1}.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    for d in ("full", "mtp_only"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    # the MTP layer in its own shard, whose bytes are garbage: loading must never open it
    save_file(sd, tmp_path / "full" / "model-00001-of-00002.safetensors")
    (tmp_path / "full" / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in sd},
                  **{k: "model-00002-of-00002.safetensors" for k in mtp}}
    (tmp_path / "full" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.arange(6)[None] + 3
    got = MoEModel.from_pretrained(tmp_path / "full").generate(ids, max_new_tokens=8, eos_token_id=[])
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, want)
    save_file(mtp, tmp_path / "mtp_only" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"multi-token-prediction.*model.layers.{n}"):
        MoEModel.from_pretrained(tmp_path / "mtp_only")


def test_the_disk_tier_reads_fp8_experts_as_int4(fp8_checkpoint, caplog):
    """Experts left on disk in FP8 are requantized on every read, as at load: the resident model's tokens, reads
    from disk, and a warning that names `moeflow quantize`."""
    dst, _, _ = fp8_checkpoint
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    want = MoEModel.from_pretrained(dst).generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    model = MoEModel.from_pretrained(dst, offload=OffloadConfig(policy="lru", gpu_expert_slots=4,
                                                                host_memory_gb=0.0005))
    assert model.experts.host.on_disk
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[]), want)
    assert model.experts.host.stats.demand_reads > 0
    assert "moeflow quantize" in caplog.text
