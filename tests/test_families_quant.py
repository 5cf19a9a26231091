"""Qwen3-MoE / Qwen2-MoE / OLMoE quantized: ``moeflow quantize`` (AWQ) and GPTQ checkpoints as published, against
transformers running on the dequantized weights (fp32 logits within 1e-4, greedy tokens equal)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from family_models import make_family_checkpoint, make_family_model
from safetensors.torch import load_file, save_file

from moeflow import MoEModel, OffloadConfig, UnsupportedQuantizationError
from moeflow.quant.awq import dequantize
from moeflow.tools.quantize import quantize_checkpoint

GROUP = 32
CONFIGS = {  # (model type, config overrides, quantize attention / dense MLPs / shared experts too)
    "qwen3-dense-layer": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
                                            intermediate_size=64), False),
    "qwen3-all-linears": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
                                            intermediate_size=64), True),
    "qwen2-shared-all-linears": ("qwen2_moe", dict(shared_expert_intermediate_size=64, intermediate_size=64), True),
    "olmoe": ("olmoe", dict(), True),
}
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def reference_model(model_type: str, overrides: dict, state: dict[str, torch.Tensor]):
    """A transformers model holding ``state`` (checkpoint names, per-expert weights dequantized to fp32); experts
    are fused into transformers 5.x's in-memory names first."""
    ref = make_family_model(model_type, seed=0, **overrides)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t.float()
    for base, per_expert in experts.items():
        order = sorted(per_expert)
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]])
                                                   for e in order])
        out[f"{base}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in order])
    ref.load_state_dict(out, strict=True)
    return ref.eval()


def check(model, ref, new_tokens: int = 24) -> None:
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    got = model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[]), want_tokens)


def awq_dequantized_state(directory) -> dict[str, torch.Tensor]:
    sd = load_file(directory / "model.safetensors")
    state = {n: t for n, t in sd.items() if not n.endswith((".qweight", ".qzeros", ".scales"))}
    for name in [n for n in sd if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        state[f"{module}.weight"] = dequantize(sd[name], sd[f"{module}.qzeros"], sd[f"{module}.scales"].float(),
                                               GROUP).T
    return state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_awq_quantized_matches_transformers_on_dequantized_weights(tmp_path, name):
    model_type, overrides, all_linears = CONFIGS[name]
    src = make_family_checkpoint(tmp_path / "fp32", model_type, seed=0, **overrides)
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=GROUP, quantize_attention=all_linears,
                              progress=False)
    names = load_file(dst / "model.safetensors").keys()
    first_moe = "model.layers.0"
    assert f"{first_moe}.mlp.experts.0.gate_proj.qweight" in names and f"{first_moe}.mlp.gate.weight" in names
    assert (f"{first_moe}.self_attn.q_proj.qweight" in names) == all_linears
    if model_type == "qwen2_moe":
        assert (f"{first_moe}.mlp.shared_expert.up_proj.qweight" in names) == all_linears
        assert f"{first_moe}.mlp.shared_expert_gate.weight" in names
    model = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    check(model, reference_model(model_type, overrides, awq_dequantized_state(dst)))


# ------------------------------------------------------------------------------------------------- GPTQ
def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: q int [K, N] -> int32 [K/8, N], nibble i of word r = row 8r + i (tests/test_gptq.py checks
    this layout against a packing written out by hand)."""
    k, n = q.shape
    words = (q.long().reshape(k // 8, 8, n) << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_checkpoint(src, dst, quantize: re.Pattern) -> dict[str, torch.Tensor]:
    """Write ``src`` as a symmetric 4-bit GPTQ checkpoint (v1 format, desc_act=false, every linear whose module
    name matches ``quantize``) into ``dst``; returns the dequantized state for the reference."""
    sd = load_file(src / "model.safetensors")
    out, state = {}, {}
    for name, t in sd.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and quantize.search(module)):
            out[name] = t.half() if t.is_floating_point() else t
            state[name] = out[name]
            continue
        w = t.float().T  # [K, N]
        k, n = w.shape
        groups = w.reshape(k // GROUP, GROUP, n)
        scales = (groups.abs().amax(1) / 7.0).clamp(min=1e-5).half()  # [K/g, N]
        q = (torch.round(groups / scales.float()[:, None]) + 8).clamp(0, 15).reshape(k, n)
        zeros = torch.full((k // GROUP, n), 8)
        out[f"{module}.qweight"] = pack_rows(q)
        out[f"{module}.qzeros"] = _pack_cols(zeros - 1)  # the v1 format stores zero - 1
        out[f"{module}.scales"] = scales
        out[f"{module}.g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
        state[f"{module}.weight"] = ((q - zeros.repeat_interleave(GROUP, 0)) * scales.float().repeat_interleave(
            GROUP, 0)).T
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"bits": 4, "group_size": GROUP, "damp_percent": 0.01, "desc_act": False,
                                  "static_groups": False, "sym": True, "true_sequential": True,
                                  "quant_method": "gptq", "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return state


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros: int [G, N] -> int32 [G, N/8], nibble i of word c = column 8c + i."""
    return pack_rows(values.T).T.contiguous()


LINEARS = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(experts\.\d+\.)?(gate|up|down)_proj)$")


@pytest.mark.parametrize("name", ["qwen3-all-linears", "qwen2-shared-all-linears", "olmoe"])
def test_gptq_matches_transformers_on_dequantized_weights(tmp_path, name):
    model_type, overrides, _ = CONFIGS[name]
    src = make_family_checkpoint(tmp_path / "fp32", model_type, seed=0, **overrides)
    state = gptq_checkpoint(src, tmp_path / "gptq", LINEARS)
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in load_file(tmp_path / "gptq" / "model.safetensors")
    model = MoEModel.from_pretrained(tmp_path / "gptq", dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    check(model, reference_model(model_type, overrides, state))


def test_gptq_act_order_is_refused_naming_the_setting(tmp_path):
    src = make_family_checkpoint(tmp_path / "fp32", "qwen3_moe")
    gptq_checkpoint(src, tmp_path / "gptq", LINEARS)
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="desc_act=true"):
        MoEModel.from_pretrained(tmp_path / "gptq")
    # a g_idx that permutes the groups is refused even when the config does not say so
    cfg["quantization_config"]["desc_act"] = False
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    sd = load_file(tmp_path / "gptq" / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.g_idx"
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, tmp_path / "gptq" / "model.safetensors")
    with pytest.raises(UnsupportedQuantizationError, match=r"experts\.2\.up_proj\.g_idx: .*desc_act=true"):
        MoEModel.from_pretrained(tmp_path / "gptq")


def test_gptq_through_the_disk_tier(tmp_path, calibration_cache):
    """The disk tier's expert index records and reads the stored GPTQ tensors and repacks them as it reads them:
    the tokens of every expert in host memory."""
    from helpers import host_budget_rows_gb

    src = make_family_checkpoint(tmp_path / "fp32", "qwen3_moe", seed=0)
    gptq_checkpoint(src, tmp_path / "gptq", LINEARS)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = MoEModel.from_pretrained(tmp_path / "gptq").generate(ids, max_new_tokens=6, do_sample=False,
                                                                    eos_token_id=[])
    model = MoEModel.from_pretrained(tmp_path / "gptq", offload=OffloadConfig(
        policy="lru", gpu_expert_slots=3, host_memory_gb=host_budget_rows_gb(tmp_path / "gptq", 4, 2),
        disk_readers=2))
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[]), expected)
        assert model.experts.host.on_disk and model.experts.host.stats.misses > 0
    finally:
        model.close()


@pytest.mark.parametrize("model_type,dtype", [("qwen3_moe", torch.bfloat16), ("qwen2_moe", torch.float16)])
def test_moeflow_quantize_command_from_16_bit(tmp_path, model_type, dtype):
    from moeflow.cli import main

    overrides = dict(intermediate_size=64, shared_expert_intermediate_size=64) if model_type == "qwen2_moe" else {}
    src = make_family_checkpoint(tmp_path / "src", model_type, seed=2, dtype=dtype, **overrides)
    assert main(["quantize", str(src), str(tmp_path / "awq"), "--group-size", str(GROUP)]) == 0
    model = MoEModel.from_pretrained(tmp_path / "awq", dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq" and model.family.name == model_type
    check(model, reference_model(model_type, overrides, awq_dequantized_state(tmp_path / "awq")), new_tokens=12)
