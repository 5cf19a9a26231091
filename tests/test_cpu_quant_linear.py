"""Quantized CPU linear layers (lm_head / embeddings / attention projections) through torch's CPU kernels."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.kernels.cpu.quant_linear import (
    awq_linear_cpu,
    int4_dequantized,
    quantize_linear_cpu,
    reference_linear,
)
from moeflow.quant.awq import quantize_rtn

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")

# kernel vs its plain-torch model (same bf16 rounding of x and y): summation order and bf16 output ulps
KERNEL_RTOL = 1e-2
# stated quantization error of the embedded model's lm_head logits vs fp32 (max over positions of
# ||logits_q - logits|| / ||logits||), measured on torch 2.13: int8 1.7% (argmax agrees everywhere),
# int4 g32 15.5% and g128 (= per channel at H 128) 21.8% (argmax agrees on 98% of positions)
LM_HEAD_RTOL = {(8, 128): 3e-2, (4, 32): 0.2, (4, 128): 0.27}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("bits,group,shape,n", [(8, 128, (96, 64), 1), (8, 128, (256, 128), 5),
                                                (4, 32, (64, 128), 3), (4, 128, (256, 256), 17)])
def test_quant_linear_matches_its_reference(bits, group, shape, n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(*shape, generator=g) * 0.05
    x = torch.randn(2, n, shape[1], generator=g)
    layer = quantize_linear_cpu(w, bits, group)
    y = layer(x)
    assert y.shape == (2, n, shape[0]) and y.dtype == x.dtype
    wq = layer.dequantized() if bits == 8 else int4_dequantized(*_rtn(w, group), group)
    assert rel(y, reference_linear(x, wq)) < KERNEL_RTOL
    assert rel(wq, w) < (1e-2 if bits == 8 else 1.2e-1)  # the quantization itself is close


def _rtn(w, group):
    t = quantize_rtn(w, group)
    return t.qweight, t.qzeros, t.scales


def test_awq_projection_as_published_goes_through_the_int4_kernel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g)
    qweight, qzeros, scales = _rtn(w, 64)
    layer = awq_linear_cpu(qweight, qzeros, scales, 64)
    assert layer.bits == 4 and layer.nbytes < w.numel()  # ~0.53 bytes per weight
    x = torch.randn(7, 256, generator=g, dtype=torch.float16)
    assert rel(layer(x), reference_linear(x, int4_dequantized(qweight, qzeros, scales, 64))) < KERNEL_RTOL


def test_int8_rows_double_as_the_embedding_table():
    w = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    layer = quantize_linear_cpu(w, 8)
    ids = torch.tensor([[0, 7, 49], [3, 3, 1]])
    emb = layer.embedding(ids)
    assert emb.shape == (2, 3, 32) and rel(emb, w[ids]) < 1e-2
    with pytest.raises(ValueError, match="bits=8"):
        quantize_linear_cpu(w.T.contiguous()[:, :32], 4, 32).embedding(ids)


def test_bad_arguments_are_named():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_linear_cpu(w, 3)
    with pytest.raises(ValueError, match="group"):
        quantize_linear_cpu(w, 4, 48)
    with pytest.raises(ValueError, match="63 features"):
        quantize_linear_cpu(w, 8)(torch.randn(2, 63))


@pytest.fixture(scope="module")
def embedded_lm_head():
    """(final normed hidden states [T, H] fp32, lm_head weight [V, H] fp32) of the embedded model on a prompt."""
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")  # the fp32 lm_head
    seen = []
    hook = model.model.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    model(ids)
    hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1]).float(), model.model.lm_head.weight.detach().float()


@pytest.mark.parametrize("bits,group", sorted(LM_HEAD_RTOL))
def test_embedded_lm_head_error_is_as_stated(embedded_lm_head, bits, group):
    h, w = embedded_lm_head
    want = h @ w.T
    got = quantize_linear_cpu(w, bits, group)(h)
    err = max(rel(got[i], want[i]) for i in range(len(h)))
    print(f"lm_head int{bits} g{group}: max relative logit error {err:.4f}, "
          f"argmax agreement {float((got.argmax(-1) == want.argmax(-1)).float().mean()):.3f}")
    assert err < LM_HEAD_RTOL[(bits, group)]


def test_int8_lm_head_takes_the_linears_place_and_keeps_greedy_tokens():
    # CPU int4 path: its lm_head is int8; 16-bit attention kept, so only the head differs between the two runs
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=None)
    fp32_head = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch").model.lm_head
    model.model.lm_head = fp32_head
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    model.model.lm_head = quantize_linear_cpu(fp32_head.weight, bits=8)
    assert "bits=8" in repr(model.model.lm_head)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[]), want)
