"""DeepSeek-V3, GLM-4.5, dots.llm1, MiniMax-M2 and Hunyuan-A13B in AWQ 4-bit (``moeflow quantize`` of a tiny random
checkpoint): logits and tokens against transformers on the dequantized weights; Fiddler (experts not on the device
computed on the CPU with the int4 kernels) keeps the all-resident tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_families import (
    DEEPSEEK_V3,
    DOTS1,
    GLM4_MOE,
    HUNYUAN,
    MINIMAX_M2,
    assert_matches_transformers,
    dequantized_reference,
    make_checkpoint,
)

from moeflow import MoEModel, OffloadConfig
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.tools.quantize import quantize_checkpoint

pytest.importorskip("transformers")
GROUP = 32
# (config, checkpoint seed, prompt seed): chosen so that the greedy path's top-1/top-2 logit margins exceed twice
# the CPU int4 kernels' deviation (bf16 activations), which the Fiddler test checks before comparing tokens
CASES = {"deepseek_v3": (DEEPSEEK_V3["qlora-groups-dense"], 16, 5),
         "glm4_moe": (GLM4_MOE["qk-norm-bias-groups"], 10, 0),
         "dots1": (DOTS1["groups-dense-shared"], 4, 1),
         "minimax_m2": (MINIMAX_M2["qk-norm-partial-rotary"], 3, 0),
         "hunyuan_v1_moe": (HUNYUAN["alpha-rope-lists-tied"], 3, 0)}


@pytest.fixture(scope="module", params=list(CASES))
def awq(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"awq_{request.param}")
    config, seed, prompt_seed = CASES[request.param]
    src, ref = make_checkpoint(root / "src", request.param, seed=seed, **config)
    dst = quantize_checkpoint(src, root / "awq", group_size=GROUP, progress=False)
    return dst, dequantized_reference(ref, dst, GROUP), prompt_seed


def test_awq_checkpoint_matches_transformers_on_dequantized_weights(awq):
    path, ref, _ = awq
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    assert_matches_transformers(model, ref)


@pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
@pytest.mark.parametrize("slots", [2, 5])
def test_fiddler_keeps_the_resident_tokens(awq, slots, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))  # never the user's calibration cache
    path, _, prompt_seed = awq
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(prompt_seed))
    resident = MoEModel.from_pretrained(path, kernels="torch")
    expected = resident.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
    want = resident(expected).logits
    model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(
        policy="fiddler", gpu_expert_slots=slots, transport="random-delay", random_delay_ms=0.3))
    try:
        out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
        got = model(expected).logits
    finally:
        model.experts.close()
    assert model.stats.prefill.cpu_experts + model.stats.decode.cpu_experts > 0
    # the CPU kernels round activations (int8 per 32 features with moeflow's own, bf16 with torch's): tokens are
    # equal by construction only where the reference's top-1/top-2 margin exceeds twice the logit deviation. This
    # random model has margins down to 0.004 against a ~0.03 deviation, so: equal tokens, or a first difference at
    # such a near-tie (a flip at a clear margin fails)
    path_logits = slice(ids.shape[1] - 1, -1)
    top2 = want[:, path_logits].topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]  # [B, new tokens]: column j chose generated token j
    deviation = float((got - want)[:, path_logits].abs().max())
    assert float((got - want).norm() / want.norm()) < 2e-2
    differs = (out != expected)[:, ids.shape[1]:]
    if differs.any():
        j = int(differs.any(0).nonzero()[0])
        rows = differs[:, j]
        assert float(margins[rows, j].max()) < 2 * deviation, f"generated token {j} flipped at a clear margin"


def test_quantize_attention_keeps_latent_attention_dense(tmp_path):
    src, _ = make_checkpoint(tmp_path / "src", "deepseek_v3", **DEEPSEEK_V3["no-qlora-unnormalised"])
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=GROUP, quantize_attention=True, progress=False)
    names = load_file(dst / "model.safetensors").keys()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.o_proj.weight" in names
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in names
    model = MoEModel.from_pretrained(dst, kernels="torch")
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, eos_token_id=[]).shape == (1, 7)
