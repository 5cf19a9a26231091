"""gpt-oss on the CPU path (device="cpu", MXFP4 experts on mxfp4.c): the biased q/k/v/o projections and the lm_head
run int8 (moeflow.engine.cpu_linears, attention_bits="auto" as the other families), each projection within 1e-2
(relative norm) of its fp32 layer; attention_bits=None keeps them fp32. (The exact-token invariant with them:
tests/test_gpt_oss_invariant.py's MXFP4 cases.) ~10 s."""

from __future__ import annotations

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint
from torch import nn

from moeflow import MoEModel
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_gpt_oss_attention_and_head_run_int8_on_the_cpu_path(tmp_path):
    if not native_available():
        pytest.skip("moeflow's CPU kernels do not build here (MXFP4 experts keep the torch reference)")
    save_gpt_oss_checkpoint(make_gpt_oss_model(seed=5), tmp_path, mxfp4=True)
    kept = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, attention_bits=None)
    quant = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert quant.kernels == "cpu-int4" and quant.experts.fmt.cpu_kernels
    assert isinstance(quant.model.lm_head, CpuQuantLinear) and quant.model.lm_head.bits == 8
    gen = torch.Generator().manual_seed(0)
    for layer_kept, layer in zip(kept.model.layers, quant.model.layers, strict=True):
        for name in PROJECTIONS:
            dense, q = getattr(layer_kept.self_attn, name), getattr(layer.self_attn, name)
            assert type(dense) is nn.Linear and isinstance(q, CpuQuantLinear) and q.bits == 8
            assert torch.equal(q.bias, dense.bias.float())  # the bias kept unquantized
            x = torch.randn(2, 3, dense.in_features, generator=gen)
            with torch.no_grad():
                want, got = dense(x), q(x)
            err = ((got - want).norm() / want.norm()).item()
            assert 0 < err < 1e-2, f"{name}: {err}"


def test_gpt_oss_gguf_attention_on_the_files_q8_0_blocks(tmp_path):
    """A gpt-oss GGUF (attention Q8_0) on device="cpu": q/k/v/o computed on the file's blocks (GGUFLinear, the
    weights exactly) with their biases, each within 1e-2 of the fp32 layer of the same (dequantized) weights; an
    offloaded model (lru, MXFP4 slots on mxfp4.c) generates the resident model's tokens."""
    pytest.importorskip("gguf")
    from gguf_gpt_oss import write_gpt_oss_gguf

    from moeflow import OffloadConfig
    from moeflow.kernels.cpu.gguf import GGUFLinear, gguf_linear_reference

    if not native_available():
        pytest.skip("moeflow's CPU kernels do not build here")
    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(make_gpt_oss_model(seed=4, intermediate_size=96, num_hidden_layers=2), path)
    kept = MoEModel.from_pretrained(path, device="cpu", dtype=torch.float32, attention_bits=None)
    model = MoEModel.from_pretrained(path, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for layer_kept, layer in zip(kept.model.layers, model.model.layers, strict=True):
        for name in PROJECTIONS:
            dense, q = getattr(layer_kept.self_attn, name), getattr(layer.self_attn, name)
            assert isinstance(q, GGUFLinear) and q.type.name == "Q8_0"
            x = torch.randn(5, dense.in_features, generator=gen)
            with torch.no_grad():
                want, got = dense(x), q(x)
                model_ref = gguf_linear_reference(x, q.blocks, q.type, q.in_features) + q.bias
            assert torch.allclose(got, model_ref, rtol=1e-5, atol=1e-5)  # the kernel's fp32 model, + the bias
            assert 0 < ((got - want).norm() / want.norm()).item() < 1e-2, name
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=[])
    want_tokens = model.generate(ids, **kw)
    for slots in (2, 3):
        offloaded = MoEModel.from_pretrained(path, device="cpu", dtype=torch.float32,
                                             offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        try:
            assert isinstance(offloaded.model.layers[0].self_attn.q_proj, GGUFLinear)
            assert torch.equal(offloaded.generate(ids, **kw), want_tokens), f"lru with {slots} slots"
        finally:
            offloaded.close()
