"""The CPU int4 path's decoder (issue 21): int8 lm_head, AWQ attention through the int4 CPU kernel, 16-bit
attention in int8 by default (issue 42; kept with attention_bits=None, int4 on request), and the lean
``CpuInt4Experts`` dispatch.

Tolerances (stated in moeflow/engine/cpu_linears.py): against the exact fp32 reference (``kernels="torch"``)
the embedded model's logits stay within LOGITS_RTOL (relative norm; measured 0.4% with torch's kernels, 0.8% with
moeflow's own (int8 activations per 32 features, moeflow/kernels/cpu/native.py), largest single logit
deviation ~0.2), the argmax agrees at every generated position of the reference's greedy path and the greedy tokens are
equal (the path's smallest top-1 / top-2 margin is ~0.04: the tokens agree because the deviations at the
competing logits are far smaller than their maximum, which a checkpoint change could undo - then this fails).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.cpu_linears import quantize_rows_int8
from moeflow.families.layers import AWQLinear
from moeflow.kernels import combine
from moeflow.kernels.cpu.int4 import Int4Expert, int4_cpu_available
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, quantize_linear_cpu
from moeflow.kernels.formats import expert_format
from moeflow.moe.resident import CpuInt4Experts
from moeflow.quant.awq import quantize_rtn
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")

LOGITS_RTOL = 2e-2
# a random-weight model whose every linear (attention, experts, lm_head) is quantized: int8 activations at each of
# its ~12 matmuls per token add ~0.5% each (measured 2.3% with moeflow's kernels, 1.2% with torch's bf16 ones)
ALL_QUANTIZED_RTOL = 3e-2
NEW_TOKENS = 32
PROMPT = "The \"with\" statement is used to wrap the execution"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def embedded():
    path = embedded_model_path()
    ref = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)])
    expected = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    return path, ref, ids, expected, ref(expected).logits


def test_cpu_int4_decoder_holds_quantized_layers_only(embedded):
    path, ref, *_ = embedded
    model = MoEOffloadedMixtral.from_pretrained(path)
    assert model.kernels == "cpu-int4" and isinstance(model.experts, CpuInt4Experts)
    head = model.model.lm_head
    assert isinstance(head, CpuQuantLinear) and head.bits == 8
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features == model.config.vocab_size
                   for name, m in model.model.named_modules() if not name.endswith("qkv_proj")), \
        "the 16-bit lm_head is still held"  # (the embedded model's fused q/k/v also has 256 outputs)
    assert head.nbytes < ref.model.lm_head.weight.numel() * 4 / 3.8  # int8 + fp32 scales: ~a quarter of fp32
    # the embedded checkpoint stores its attention in 16 bits: int8 by default on this path, kept when asked
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, CpuQuantLinear) and q.bits == 8
    kept = MoEOffloadedMixtral.from_pretrained(path, attention_bits=None)
    assert type(kept.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    # the reference is untouched
    assert type(ref.model.lm_head) is torch.nn.Linear


def test_logits_close_and_greedy_equal_on_the_embedded_model(embedded):
    path, _, ids, expected, logits = embedded
    for attention_bits in (None, "auto"):
        model = MoEOffloadedMixtral.from_pretrained(path, attention_bits=attention_bits)
        got = model(expected).logits
        err = rel(got, logits)
        assert err < LOGITS_RTOL, f"attention_bits={attention_bits}: relative logit error {err:.2e}"
        # teacher-forced on the reference's greedy path: the same argmax at every generated position
        gen = slice(ids.shape[1] - 1, None)
        assert torch.equal(got[:, gen].argmax(-1), logits[:, gen].argmax(-1)), f"attention_bits={attention_bits}"
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        assert torch.equal(out, expected), f"attention_bits={attention_bits}"


def test_int8_layers_quantized_from_the_stored_dtype_equal_the_fp32_path(embedded):
    """from_pretrained quantizes the fp16 lm_head and attention projections to int8 from the checkpoint's bytes
    (cpu_linears.quantize_rows_int8, never widened to an fp32 matrix): the buffers are bit for bit what
    quantize_linear_cpu makes from the fp32 weights the reference holds."""
    path, ref, *_ = embedded
    model = MoEOffloadedMixtral.from_pretrained(path, attention_bits=8)
    pairs = [(model.model.lm_head, ref.model.lm_head.weight),
             (model.model.layers[1].self_attn.o_proj, ref.model.layers[1].self_attn.o_proj.weight)]
    for got, weight in pairs:
        assert weight.dtype == torch.float32
        want = dict(quantize_linear_cpu(weight.detach(), bits=8).named_buffers())
        have = dict(got.named_buffers())
        assert have.keys() == want.keys()
        for name in want:
            assert have[name].dtype == want[name].dtype and torch.equal(have[name], want[name]), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_rows_int8_equals_quantize_linear_cpu(dtype):
    """The one-pass int8 quantizer from a weight as stored against quantize_linear_cpu of its fp32 widening: rows
    not a multiple of 8 (the plain tail), mixed scales, an all-zero row, exact halves and fp16 subnormals."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(45, 96, generator=g) * torch.logspace(-4, 1, 45)[:, None]
    w[3] = 0.0
    w[5, :8] = torch.arange(8) + 0.5
    w[7, :4] = torch.tensor([6e-8, -6e-8, 3e-5, -1e-7])
    w = w.to(dtype)
    want = dict(quantize_linear_cpu(w.float(), bits=8).named_buffers())
    have = dict(quantize_rows_int8(w).named_buffers())
    assert have.keys() == want.keys()
    for name in want:
        assert have[name].dtype == want[name].dtype and torch.equal(have[name], want[name]), name


def test_attention_bits_quantizes_16_bit_projections_when_asked(embedded):
    path, ref, ids, _, _ = embedded
    for bits in (8, 4):
        model = MoEOffloadedMixtral.from_pretrained(path, attention_bits=bits)
        attn = model.model.layers[1].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layer = getattr(attn, name)
            assert isinstance(layer, CpuQuantLinear) and layer.bits == bits, name
        # each projection is its own weight, quantized: within the format's error of the 16-bit one
        w = ref.model.layers[1].self_attn.k_proj.weight.detach()
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(bits))
        assert rel(attn.k_proj(x), x @ w.T) < (2e-2 if bits == 8 else 0.2)
        assert model(ids).logits.isfinite().all()


def test_attention_bits_is_validated(embedded):
    path, *_ = embedded
    with pytest.raises(ValueError, match="attention_bits=5"):
        MoEOffloadedMixtral.from_pretrained(path, attention_bits=5)
    with pytest.raises(ValueError, match="CPU int4 path"):
        MoEOffloadedMixtral.from_pretrained(path, kernels="torch", attention_bits=8)
    # "auto" (the default) off the CPU int4 path keeps the projections as stored: the exact fp32 reference
    ref = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    assert type(ref.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_awq_attention_runs_the_int4_cpu_kernel(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    awq = quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    ref = MoEOffloadedMixtral.from_pretrained(awq, kernels="torch")
    model = MoEOffloadedMixtral.from_pretrained(awq)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(ref.model.layers[0].self_attn, name), AWQLinear)
        layer = getattr(model.model.layers[0].self_attn, name)
        assert isinstance(layer, CpuQuantLinear) and layer.bits == 4 and layer.group_size == 32, name
    # the same int4 weights: only the rounding of activations (bf16, or int8 per 32) separates the projections
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    a, b = ref.model.layers[0].self_attn.q_proj(x), model.model.layers[0].self_attn.q_proj(x)
    assert rel(b, a) < 1e-2
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    assert rel(model(ids).logits, ref(ids).logits) < ALL_QUANTIZED_RTOL


def test_quant_linear_bias():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(32, generator=torch.Generator().manual_seed(3))
    layer = quantize_linear_cpu(w, bits=8)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    plain = layer(x)
    layer.set_bias(bias)
    assert torch.allclose(layer(x), plain + bias, atol=0.05)
    with pytest.raises(ValueError, match="outputs"):
        layer.set_bias(torch.zeros(7))


def _old_dispatch(experts: list[Int4Expert], x, topk_ids, topk_weights):
    """The dispatch CpuInt4Experts had before issue 21 (unique + nonzero per expert), as the oracle."""
    k = topk_ids.shape[1]
    flat_ids, flat_w = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    out = torch.empty((flat_ids.numel(), x.shape[-1]), dtype=x.dtype)
    for e in torch.unique(flat_ids).tolist():
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        out[pairs] = experts[e].forward(x[pairs // k], flat_w[pairs])
    return combine(out, k)


@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_dispatch_gives_the_same_numbers(tokens, dtype):
    H, I, E, k, g = 64, 96, 4, 2, 32  # noqa: E741
    fmt = expert_format(H, I, "awq", torch.float16, g)
    backend = CpuInt4Experts(fmt, 1, E)
    gen = torch.Generator().manual_seed(tokens)
    for e in range(E):
        w13, w2 = quantize_rtn(torch.randn(2 * I, H, generator=gen) * 0.1, g), \
            quantize_rtn(torch.randn(H, I, generator=gen) * 0.1, g)
        backend.load_expert(0, e, {"w13_qweight": w13.qweight, "w13_qzeros": w13.qzeros, "w13_scales": w13.scales,
                                   "w2_qweight": w2.qweight, "w2_qzeros": w2.qzeros, "w2_scales": w2.scales})
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    got = backend.forward(0, x, None, ids, weights)
    assert got.dtype == dtype
    assert torch.equal(got, _old_dispatch(backend.experts[0], x, ids, weights))
