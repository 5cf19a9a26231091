"""The lean CPU decode step (issue 21, engine/cpu_step.py): fused q/k/v, one-call RMSNorm (+ residual add) and
one-call rotary + KV-cache write + attention, each against its fp32 torch model, and the fused model against the
unfused one (the same weights and kernels, only the glue differs).

Tolerances: the ops match their fp32 models to ~1e-6 relative (RMSNorm_RTOL, ATTN_RTOL; the rotary keys written
into the cache exactly); whole models: logits within STEP_RTOL (relative norm) of the unfused step, and the
same greedy tokens. Measured 1.4e-4 on the embedded model: the kernels round activations to int8 per 32 features,
so a 1e-7 difference that moves one value across a rounding boundary changes it by a whole int8 step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_checkpoint, make_tiny_model

import moeflow.engine.build as build
from moeflow import MoEModel, MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.cpu_step import fuse_qkv, set_cpu_step_fused
from moeflow.engine.kv_cache import StaticKVCache, attention_mask
from moeflow.engine.loading import non_expert_bytes
from moeflow.families.layers import Attention, RMSNorm, RotaryEmbedding, apply_rotary
from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.matrix_reference import q4_expert_reference, q4_reference
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, q4_expert
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, quantize_linear_cpu
from moeflow.kernels.cpu.step import (
    QKNorm,
    attention_block,
    attention_step,
    attention_step_reference,
    expert_row,
    experts_step,
    rmsnorm,
    rmsnorm_reference,
    router_logits,
    shared_expert_reference,
    shared_expert_step,
    softmax_topk,
    softmax_topk_reference,
)
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")

NORM_RTOL = 1e-6
ATTN_RTOL = 1e-5
STEP_RTOL = 1e-3
PROMPT = "The \"with\" statement is used to wrap the execution"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rmsnorm_matches_its_reference_and_the_torch_norm():
    x = torch.randn(3, 5, 64, generator=_gen(0)) * 3
    res = torch.randn(3, 5, 64, generator=_gen(1))
    w = torch.randn(64, generator=_gen(2))
    out, total = rmsnorm(x, w, 1e-5)
    assert total is None and rel(out, rmsnorm_reference(x, w, 1e-5)[0]) < NORM_RTOL
    out, total = rmsnorm(x, w, 1e-5, residual=res)
    ref_out, ref_total = rmsnorm_reference(x, w, 1e-5, residual=res)
    assert torch.equal(total, ref_total)  # the residual add rounds as torch's
    assert rel(out, ref_out) < NORM_RTOL
    norm = RMSNorm(64, 1e-5, torch.float32)
    norm.weight.data.copy_(w)
    plain_total, plain = norm(x, residual=res)
    norm.native = True
    fused_total, fused = norm(x, residual=res)
    assert torch.equal(fused_total, plain_total) and rel(fused, plain) < NORM_RTOL
    assert rel(norm(x), rmsnorm_reference(x, w, 1e-5)[0]) < NORM_RTOL
    with pytest.raises(ValueError, match="x: expected a contiguous fp32"):
        rmsnorm(x.double(), w, 1e-5)


@pytest.mark.parametrize("batch,steps,heads,kv_heads", [(1, 1, 4, 2), (2, 3, 4, 4), (2, 1, 8, 2)])
def test_attention_step_matches_its_reference_and_sdpa(batch, steps, heads, kv_heads):
    d, length, start = 16, 12, 5
    g = _gen(batch * 100 + steps * 10 + heads)
    qkv = torch.randn(batch, steps, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = RotaryEmbedding(d, 1e4)(torch.arange(start, start + steps).expand(batch, steps), torch.float32)
    pos = torch.arange(start, start + steps)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :2] = False  # a left-padded row
    valid[:, start + steps:] = False
    mask = attention_mask(valid, pos, None)
    k0 = torch.randn(batch, kv_heads, length, d, generator=g)
    v0 = torch.randn(batch, kv_heads, length, d, generator=g)
    kc, vc, kr, vr = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    out = attention_step(qkv, heads, kv_heads, cos.contiguous(), sin.contiguous(), kc, vc, pos, mask)
    ref = attention_step_reference(qkv, heads, kv_heads, cos, sin, kr, vr, pos, mask)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the same rotated keys and values in the cache
    assert rel(out, ref) < ATTN_RTOL
    # and the Attention module's own torch path (rotary, index_copy_, SDPA with GQA)
    q, k, v = qkv.view(batch, steps, heads + 2 * kv_heads, d).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ks, vs = k0.clone(), v0.clone()
    ks.index_copy_(2, pos, k)
    vs.index_copy_(2, pos, v)
    sdpa = F.scaled_dot_product_attention(q, ks.repeat_interleave(heads // kv_heads, 1),
                                          vs.repeat_interleave(heads // kv_heads, 1), attn_mask=mask)
    assert rel(out, sdpa.transpose(1, 2).reshape(batch, steps, heads * d)) < ATTN_RTOL


def _qk_norm(per_head: bool | None, heads: int, kv_heads: int, d: int, g: torch.Generator) -> QKNorm | None:
    """Random QK-norm weights around 1 (None: no QK-norm)."""
    if per_head is None:
        return None
    nq, nk = (d, d) if per_head else (heads * d, kv_heads * d)
    return QKNorm(torch.rand(nq, generator=g) + 0.5, torch.rand(nk, generator=g) + 0.5, 1e-6, per_head)


def _normed_qkv(qkv: torch.Tensor, norm: QKNorm, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [B, T, F] with q and k put through the QK-norm by separate :func:`rmsnorm` calls (the per-layer
    path's q_norm / k_norm modules)."""
    b, t, f = qkv.shape
    d = f // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    if norm.per_head:
        q, k = q.reshape(b, t, heads, d), k.reshape(b, t, kv_heads, d)
    q, k = rmsnorm(q.contiguous(), norm.q, norm.eps)[0], rmsnorm(k.contiguous(), norm.k, norm.eps)[0]
    return torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v), dim=-1)


@pytest.mark.parametrize("per_head", [True, False])
def test_attention_step_with_a_qk_norm_is_the_norm_calls_then_the_step(per_head):
    """Qwen3's per-head QK-norm and OLMoE's over the projection, inside the attention op: bit for bit
    :func:`rmsnorm` on the q and k rows and then the op without it; its fp32 model and the Attention module's torch
    path (q_norm / k_norm modules, rotary, SDPA) within ATTN_RTOL."""
    b, t, heads, kv_heads, d, length, start = 2, 3, 4, 2, 16, 10, 4
    g = _gen(40 + per_head)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=g) * 2
    norm = _qk_norm(per_head, heads, kv_heads, d, g)
    pos = torch.arange(start, start + t)
    cos, sin = RotaryEmbedding(d, 1e4)(pos.expand(b, t), torch.float32)
    valid = torch.zeros(b, length, dtype=torch.bool)
    valid[:, :start + t] = True
    valid[1, :2] = False
    mask = attention_mask(valid, pos, None)
    caches = [torch.randn(b, kv_heads, length, d, generator=g) for _ in range(2)]
    k1, v1, k2, v2, k3, v3 = (c.clone() for c in caches * 3)
    out = attention_step(qkv, heads, kv_heads, cos, sin, k1, v1, pos, mask, norm)
    sep = attention_step(_normed_qkv(qkv, norm, heads, kv_heads), heads, kv_heads, cos, sin, k2, v2, pos, mask)
    assert torch.equal(out, sep) and torch.equal(k1, k2) and torch.equal(v1, v2)
    plain = attention_step(qkv, heads, kv_heads, cos, sin, k3, v3, pos, mask)
    assert rel(plain, out) > 1e-2  # the norm changes the result (weights not 1)
    k4, v4 = (c.clone() for c in caches)
    assert rel(out, attention_step_reference(qkv, heads, kv_heads, cos, sin, k4, v4, pos, mask, norm)) < ATTN_RTOL
    attn = Attention(heads * d, heads, kv_heads, d, 0, lambda name, fan_in, fan_out: torch.nn.Linear(fan_in, fan_out),
                     qk_norm="head" if per_head else "projection", norm_eps=norm.eps)
    attn.q_norm.weight.data.copy_(norm.q)
    attn.k_norm.weight.data.copy_(norm.k)
    q, k, v = qkv.view(b, t, heads + 2 * kv_heads, d).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
    q, k, v = attn._normalize_qkv(q, k, v)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ks, vs = (c.clone() for c in caches)
    ks.index_copy_(2, pos, k)
    vs.index_copy_(2, pos, v)
    groups = heads // kv_heads
    sdpa = F.scaled_dot_product_attention(q, ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1),
                                          attn_mask=mask)
    assert rel(out, sdpa.transpose(1, 2).reshape(b, t, heads * d)) < ATTN_RTOL
    with pytest.raises(ValueError, match="QK-norm weights"):
        attention_step(qkv, heads, kv_heads, cos, sin, k3, v3, pos, mask, QKNorm(norm.k, norm.q, 1e-6, per_head)
                       if not per_head else QKNorm(norm.q[:8].contiguous(), norm.k, 1e-6, True))


@pytest.mark.parametrize("bits,per_head", [(4, None), (8, None), (4, True), (8, False)])
def test_attention_block_is_the_separate_calls(bits, per_head):
    b, t, h, heads, kv_heads, d, length = 2, 3, 64, 4, 2, 16, 9
    g = _gen(bits)
    qkv = quantize_linear_cpu(torch.randn((heads + 2 * kv_heads) * d, h, generator=g) * 0.2, bits, group_size=32)
    o = quantize_linear_cpu(torch.randn(h, heads * d, generator=g) * 0.2, bits, group_size=32)
    x = torch.randn(b, t, h, generator=g)
    w_in, w_post = torch.rand(h, generator=g) + 0.5, torch.rand(h, generator=g) + 0.5
    pos = torch.arange(2, 2 + t)
    cos, sin = RotaryEmbedding(d, 1e4)(pos.expand(b, t), torch.float32)
    valid = torch.zeros(b, length, dtype=torch.bool)
    valid[:, :2 + t] = True
    valid[1, 0] = False
    mask = attention_mask(valid, pos, None)
    caches = [torch.randn(b, kv_heads, length, d, generator=g) for _ in range(2)]
    k1, v1, k2, v2 = (c.clone() for c in caches + caches)
    norm = _qk_norm(per_head, heads, kv_heads, d, g)
    x_out, h_out = attention_block(x, w_in, w_post, 1e-5, qkv, o, heads, kv_heads, cos, sin, k1, v1, pos, mask,
                                   norm)
    normed, _ = rmsnorm(x, w_in, 1e-5)
    a = attention_step(qkv(normed), heads, kv_heads, cos, sin, k2, v2, pos, mask, norm)
    after, total = rmsnorm(x, w_post, 1e-5, residual=o(a))
    assert torch.equal(x_out, total) and torch.equal(h_out, after) and torch.equal(k1, k2) and torch.equal(v1, v2)
    # and the plain-torch fp32 model of each step
    w_qkv = qkv.dequantized() if bits == 8 else Q4Matrix(qkv.packed, qkv.scales, qkv.mins, 32).dequantized()
    w_o = o.dequantized() if bits == 8 else Q4Matrix(o.packed, o.scales, o.mins, 32).dequantized()
    k3, v3 = (c.clone() for c in caches)
    ref_a = attention_step_reference(q4_reference(rmsnorm_reference(x, w_in, 1e-5)[0], w_qkv), heads, kv_heads,
                                     cos, sin, k3, v3, pos, mask, norm)
    ref_h, ref_total = rmsnorm_reference(x, w_post, 1e-5, residual=q4_reference(ref_a, w_o))
    # int8 activation rounding turns ~1e-7 differences into whole int8 steps at a few elements
    assert rel(x_out, ref_total) < 1e-3 and rel(h_out, ref_h) < 1e-3


def test_experts_step_is_the_accumulating_expert_calls():
    g = _gen(11)
    hidden, inter = 64, 96

    def matrix(n, k):
        return quantize_linear_cpu(torch.randn(n, k, generator=g) * 0.1, 4, group_size=32)

    experts = []
    for _ in range(3):
        w13, w2 = matrix(2 * inter, hidden), matrix(hidden, inter)
        experts.append(tuple(Q4Matrix(m.packed, m.scales, m.mins, 32) for m in (w13, w2)))
    x = torch.randn(1, hidden, generator=g)
    weights = torch.softmax(torch.randn(1, 3, generator=g), -1)
    out = None
    for j, (w13, w2) in enumerate(experts):
        out = q4_expert(x, w13, w2, weights[:, j], out)
    assert torch.equal(experts_step(x, experts, weights), out)
    ref = sum(q4_expert_reference(x, w13.dequantized(), w2.dequantized(), weights[:, j])
              for j, (w13, w2) in enumerate(experts))
    assert rel(out, ref) < 1e-3


def test_shared_expert_step_is_the_expert_call_with_its_sigmoid_gate():
    """A shared expert (Qwen2-MoE's, with its sigmoid output gate): one q4 expert call weighted per token by
    sigmoid(x . gate) (1 without a gate), and its fp32 model; the GatedMLP module's native step is that call."""
    g = _gen(12)
    hidden, inter, t = 64, 96, 3
    w13, w2 = (quantize_linear_cpu(torch.randn(n, k, generator=g) * 0.1, 4, group_size=32)
               for n, k in ((2 * inter, hidden), (hidden, inter)))
    w13, w2 = (Q4Matrix(m.packed, m.scales, m.mins, 32) for m in (w13, w2))
    x = torch.randn(t, hidden, generator=g)
    gate = torch.randn(hidden, generator=g) * 0.3
    out = shared_expert_step(x, w13, w2, gate)
    assert torch.equal(shared_expert_step(x, w13, w2, None), q4_expert(x, w13, w2, torch.ones(t)))
    dense = (w13.dequantized(), w2.dequantized())
    assert rel(out, shared_expert_reference(x, *dense, gate)) < 1e-3
    assert rel(out, shared_expert_reference(x, *dense, None)) > 0.1  # the gate is applied
    with pytest.raises(ValueError, match="shared_expert_step"):
        shared_expert_step(x, w2, w13, gate)


def test_expert_row_writes_the_weighted_expert_output_into_its_row():
    g = _gen(12)
    hidden, inter = 64, 96

    def matrix(n, k):
        m = quantize_linear_cpu(torch.randn(n, k, generator=g) * 0.1, 4, group_size=32)
        return Q4Matrix(m.packed, m.scales, m.mins, 32)

    experts = [(matrix(2 * inter, hidden), matrix(hidden, inter)) for _ in range(3)]
    x = torch.randn(1, hidden, generator=g)
    weights = torch.softmax(torch.randn(3, generator=g), -1)
    out = torch.full((3, hidden), float("nan"))
    for j in (2, 0, 1):  # any order: each call writes its own row only
        expert_row(x, *experts[j], weights, j, out)
    for j, (w13, w2) in enumerate(experts):
        assert torch.equal(out[j:j + 1], q4_expert(x, w13, w2, weights[j:j + 1]))
    with pytest.raises(ValueError, match="row 3"):
        expert_row(x, *experts[0], weights, 3, out)


def test_router_ops_match_their_references():
    g = _gen(13)
    x, w = torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g)
    logits = router_logits(x, w)
    assert rel(logits, x @ w.T) < NORM_RTOL
    for renormalize in (True, False):
        probs, ids, weights = softmax_topk(logits, 2, renormalize)
        ref_probs, ref_ids, ref_weights = softmax_topk_reference(logits, 2, renormalize)
        assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
        assert rel(probs, ref_probs) < NORM_RTOL and rel(weights, ref_weights) < NORM_RTOL
    tie = torch.zeros(1, 4)  # equal probabilities: the lower expert index first
    assert softmax_topk(tie, 2)[1].tolist() == [[0, 1]]


def test_attention_step_rejects_a_wrong_cache():
    qkv = torch.randn(1, 1, 8 * 16)
    cos = sin = torch.ones(1, 1, 16)
    cache = torch.zeros(1, 3, 8, 16)  # 3 kv heads for qkv's 2 + 2 * 3 = 8 heads: the shapes disagree
    with pytest.raises(ValueError, match="k/v cache"):
        attention_step(qkv, 4, 2, cos, sin, cache, cache.clone(), torch.tensor([0]),
                       torch.ones(1, 1, 1, 8, dtype=torch.bool))


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_fused_qkv_is_the_three_projections_with_their_memory_shared(bits):
    g = _gen(7)
    weights = [torch.randn(n, 64, generator=g) for n in (64, 32, 32)]
    if bits is None:
        projections = []
        for w in weights:
            p = torch.nn.Linear(64, w.shape[0], bias=False)
            p.weight.data.copy_(w)
            projections.append(p)
    else:
        projections = [quantize_linear_cpu(w, bits=bits, group_size=32) for w in weights]
    module = torch.nn.Module()
    for name, p in zip(("q", "k", "v"), projections, strict=True):
        setattr(module, name, p)
    x = torch.randn(3, 64, generator=g)
    separate = torch.cat([p(x) for p in projections], -1)
    before = non_expert_bytes(module)
    fused = fuse_qkv(projections)
    module.qkv = fused
    assert isinstance(fused, torch.nn.Linear if bits is None else CpuQuantLinear)
    assert torch.equal(fused(x), separate)  # per output row the same computation
    assert torch.equal(torch.cat([p(x) for p in projections], -1), separate)  # the views still compute the same
    assert non_expert_bytes(module) == before  # the rows are held once


def _unfused(path, **kw) -> MoEModel:
    """The model as built before the CPU step was fused (fuse_cpu_step not called at all)."""
    orig = build.fuse_cpu_step
    build.fuse_cpu_step = lambda decoder, dtype: {"attention": 0, "norm": 0}
    try:
        return MoEModel.from_pretrained(path, **kw)
    finally:
        build.fuse_cpu_step = orig


def _check_same_model(path, ids, new_tokens=24, **kw):
    fused, plain = MoEModel.from_pretrained(path, **kw), _unfused(path, **kw)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn, Attention) and attn.qkv_proj is not None and attn.fused_step
    assert fused.model.layers[0].input_layernorm.native and not plain.model.layers[0].input_layernorm.native
    assert plain.model.layers[0].self_attn.qkv_proj is None
    quantized = isinstance(attn.q_proj, (CpuQuantLinear, GGUFLinear))  # then the whole attention half is one call
    assert (fused.model.layers[0].attention_step is not None) == quantized
    with torch.inference_mode():
        out = fused.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        assert torch.equal(out, plain.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[]))
        # the whole sequence teacher-forced (prefill), then the decode steps' logits through generate's scores
        assert rel(fused(out).logits, plain(out).logits) < STEP_RTOL
    return fused, plain


@pytest.mark.parametrize("attention_bits", [None, 8, 4])
def test_fused_step_gives_the_unfused_logits_and_tokens_on_the_embedded_model(attention_bits):
    path = embedded_model_path()
    tok = MoEOffloadedMixtral.from_pretrained(path, kernels="torch").tokenizer
    ids = torch.tensor([tok.encode(PROMPT)])
    _check_same_model(path, ids, attention_bits=attention_bits)


def test_fused_step_on_an_awq_attention_checkpoint_with_padding(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    awq = quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    ids = torch.randint(3, 97, (2, 7), generator=_gen(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the mask reaches the attention op
    fused, plain = _check_same_model(awq, ids)
    assert fused.model.layers[0].self_attn.qkv_proj.bits == 4
    with torch.inference_mode():
        a = fused.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[])
        b = plain.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[])
    assert torch.equal(a, b)
    # switched off, the fused model runs the unfused step (q/k/v as views of the fused rows): the same logits
    with torch.inference_mode():
        on = fused(ids, attention_mask=mask).logits
        set_cpu_step_fused(fused.model, False)
        assert not fused.model.layers[0].self_attn.fused_step and not fused.model.layers[0].block_sparse_moe.gate.native
        assert torch.equal(fused(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
        set_cpu_step_fused(fused.model, True)
        assert torch.equal(fused(ids, attention_mask=mask).logits, on)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen2_moe"])
def test_fused_step_with_a_qk_norm_gives_the_unfused_logits_and_tokens(tmp_path, family):
    """Qwen3-MoE (QK-norm per head) and OLMoE (over the projection) with AWQ attention: the QK-norm inside the
    attention op (prefill and decode) against the unfused modules; Qwen2-MoE: its q/k/v bias inside the attention
    half and its shared expert (sigmoid output gate) as one call."""
    from family_models import make_family_checkpoint

    shape = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    if family != "olmoe":
        shape.update(moe_intermediate_size=128, norm_topk_prob=True)
    if family == "qwen2_moe":
        shape.update(shared_expert_intermediate_size=128)
    src = make_family_checkpoint(tmp_path / "fp32", family, seed=4, **shape)
    awq = quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    fused, _ = _check_same_model(awq, torch.randint(3, 97, (1, 7), generator=_gen(3)), new_tokens=12)
    attn = fused.model.layers[0].self_attn
    assert attn.qk_norm == {"qwen3_moe": "head", "olmoe": "projection", "qwen2_moe": None}[family]
    assert fused.model.layers_step is not None and fused.model.layers[0].attention_step is not None
    if family == "qwen2_moe":
        assert attn.qkv_proj.bias is not None and fused.model.layers[0].mlp.shared_expert.native_step is not None


def test_cache_layer_views_are_the_cache():
    cache = StaticKVCache(3, 2, 8, 2, 4, torch.float32, "cpu")
    k, v = cache.layer_kv[1]
    k.fill_(1.0)
    v.fill_(2.0)
    assert cache.k[1].eq(1).all() and cache.v[1].eq(2).all() and cache.k[0].eq(0).all()


def test_fused_step_on_a_q4_k_m_gguf(tmp_path, monkeypatch):
    """GGUF experts read as stored (Q4_K gate/up, Q6_K / Q4_K down by layer: Q4_K_M's mix) on ``device="cpu"``:
    the fused step (its decode steps one native call through every layer, GGUF experts inside) gives the unfused
    model's tokens and logits. (The attention as int8, ``attention_bits=8``: with the file's Q8_0 blocks, the
    default since session 18, the unfused model's torch norms and attention (summation order) move one position of
    this sequence across a discrete boundary (an activation's int8 rounding or a routing choice): its logits by
    7e-3, the others' within 1e-6; the native paths against each
    other, bit for bit: tests/test_cpu_gguf_block_attention.py, tests/test_cpu_layers.py.)"""
    pytest.importorskip("gguf")
    from gguf_models import T, k_mix_experts, write_gguf

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_local_experts=4,
                            num_experts_per_tok=2)
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0,
               raw_experts=k_mix_experts([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")], 4, 256, 256))
    ids = torch.randint(3, 97, (1, 6), generator=_gen(8))
    fused, plain = _check_same_model(path, ids, new_tokens=8, device="cpu", attention_bits=8)
    assert fused.model.layers_step is not None and plain.model.layers_step is None
    assert fused.experts.fmt.down_types == ("Q4_K", "Q6_K") and fused.experts.fmt.cpu_kernels
