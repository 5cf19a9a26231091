"""The Gated DeltaNet's Triton kernels (moeflow.kernels.deltanet.kernels, interpreter: TRITON_INTERPRET=1) against
their torch references (moeflow.families.gated_deltanet): the decode conv and the fused recurrence (gates, L2 norm
and query scale inside; over a prompt too, against the chunked form) give the reference's outputs and states (fp32:
2e-6; bf16: one bf16 ulp of the outputs, see BF16), a masked token or row leaves its states bitwise as they were,
and a layer on the kernels gives the reference layer's outputs and states over prefill + decode steps, eager and
through the custom ops (torch.compile)."""

from __future__ import annotations

import pytest
import torch
from test_gated_deltanet import make_layer, new_cache, run

from moeflow.families.gated_deltanet import (
    DeltaNetShape,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from moeflow.kernels import deltanet

FP32 = dict(rtol=2e-6, atol=2e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16 rounding of the conv output / o between the two paths (one ulp: 2^-8)


def layer_of(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0, fused: bool = False,
             kernel: int = 4) -> GatedDeltaNet:
    shape = DeltaNetShape(hidden_size=24, num_k_heads=hk, num_v_heads=hv, k_head_dim=dk, v_head_dim=dv,
                          conv_kernel=kernel, fused_projections=fused)
    layer = GatedDeltaNet(shape, 0, lambda name, i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype), dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "proj" in name or "conv" in name else 0.5))
    return layer


def decode_inputs(layer: GatedDeltaNet, bsz: int, t: int, dtype: torch.dtype, seed: int):
    s = layer.shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(bsz, t, s.conv_dim, generator=gen).to(dtype)
    a, b = (torch.randn(bsz, t, s.num_v_heads, generator=gen).to(dtype) for _ in range(2))
    state = torch.randn(bsz, s.num_v_heads, s.k_head_dim, s.v_head_dim, generator=gen) * 0.3
    return qkv, a, b, state


# ------------------------------------------------------------------ the decode conv
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FP32), (torch.bfloat16, BF16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", [2, 4, 5])
def test_conv_decode_equals_the_reference_conv(dtype, tol, kernel):
    layer = layer_of(2, 4, 12, 20, dtype, seed=kernel, kernel=kernel)
    c = layer.shape.conv_dim  # 2 * 24 + 80 = 128: the block of 256 channels masked
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 1, c, generator=gen).to(dtype)
    state = torch.randn(3, kernel - 1, c, generator=gen).to(dtype)
    mask = torch.tensor([[True], [False], [True]])
    want, want_state = layer.conv(qkv, state.clone(), mask)
    got_state = state.clone()
    got = deltanet.conv_decode(qkv, got_state, layer.conv1d.weight, mask)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got_state, want_state.to(dtype))  # a shift: exact
    assert torch.equal(got_state[1], state[1])


# ------------------------------------------------------------------ the fused recurrence
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 8, 6), (3, 3, 12, 40), (1, 4, 16, 33), (2, 2, 20, 64)])
@pytest.mark.parametrize("t", [1, 5])
def test_recurrent_kernel_equals_the_reference(hk, hv, dk, dv, t):
    """Gates, L2 norm and scale from the raw conv output and a/b; several value blocks (dv 40, 33, 64 > 32), odd
    dims, r = 1, 2, 4 value heads a key head; a padding token in the middle of row 1."""
    layer = layer_of(hk, hv, dk, dv, torch.float32, seed=dk + dv)
    qkv, a, b, state = decode_inputs(layer, 3, t, torch.float32, seed=t)
    mask = torch.ones(3, t, dtype=torch.bool)
    mask[1, t // 2] = False
    q, k, v, g, beta = layer.rule_inputs(qkv, a, b, mask)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got_state = state.clone()
    got = deltanet.recurrent(qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, hk, dk, torch.float32)
    assert got.shape == (3, t, hv, dv)
    torch.testing.assert_close(got, want.transpose(1, 2), **FP32)
    torch.testing.assert_close(got_state, want_state, **FP32)


def test_recurrent_kernel_with_bf16_inputs():
    layer = layer_of(2, 4, 16, 24, torch.bfloat16, seed=3)
    qkv, a, b, state = decode_inputs(layer, 2, 3, torch.bfloat16, seed=4)
    mask = torch.ones(2, 3, dtype=torch.bool)
    q, k, v, g, beta = layer.rule_inputs(qkv, a, b, mask)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got_state = state.clone()
    got = deltanet.recurrent(qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, 2, 16, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.transpose(1, 2).to(torch.bfloat16), **BF16)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)  # fp32 from the same bf16 inputs


def test_masked_tokens_leave_the_recurrent_state_bitwise_unchanged():
    """A row whose tokens are all padding keeps every bit of its state (inf/NaN-free or not: no x * 1 + 0)."""
    layer = layer_of(2, 4, 8, 12, torch.float32, seed=5)
    qkv, a, b, state = decode_inputs(layer, 3, 4, torch.float32, seed=6)
    state[1, 0, 0, 0] = -0.0  # -0.0 + 0.0 would give +0.0
    mask = torch.tensor([[True] * 4, [False] * 4, [False, True, False, True]])
    got_state = state.clone()
    deltanet.recurrent(qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, 2, 8, torch.float32)
    assert torch.equal(got_state[1], state[1]) and torch.signbit(got_state[1, 0, 0, 0])
    assert not torch.equal(got_state[0], state[0]) and not torch.equal(got_state[2], state[2])
    one = state[2:].clone()  # row 2's real tokens alone give its state: the padding steps changed nothing
    deltanet.recurrent(qkv[2:, [1, 3]], a[2:, [1, 3]], b[2:, [1, 3]], layer.A_log, layer.dt_bias,
                       mask[2:, [1, 3]], one, 2, 8, torch.float32)
    assert torch.equal(one[0], got_state[2])


# ------------------------------------------------------------------ prefill: the same kernel over a prompt
def test_recurrent_kernel_over_a_prompt_equals_the_chunked_reference():
    """90 tokens (a whole chunk of the reference's prefill form and a ragged tail), left padding on row 1."""
    layer = layer_of(2, 4, 16, 12, torch.float32, seed=9)
    qkv, a, b, state = decode_inputs(layer, 2, 90, torch.float32, seed=10)
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[1, :13] = False
    q, k, v, g, beta = layer.rule_inputs(qkv, a, b, mask)
    want, want_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    got_state = state.clone()
    got = deltanet.recurrent(qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, 2, 16, torch.float32)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the layer
def kernel_layer(fused: bool) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    ref = make_layer(fused)
    fast = make_layer(fused)
    fast.use_kernels("triton")
    ref.use_kernels("torch")
    return ref, fast


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
def test_layer_on_kernels_equals_the_reference_layer(fused):
    """Prefill (torch conv + fused recurrence) then decode steps (conv kernel + fused recurrence), left padding and a
    finished row."""
    ref, fast = kernel_layer(fused)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False
    mask[0, 10:] = False  # row 0 finished: its states stay
    caches = [new_cache(ref, 2), new_cache(fast, 2)]
    outs: list[list[torch.Tensor]] = [[], []]
    for i, layer in enumerate((ref, fast)):
        outs[i].append(run(layer, caches[i], x[:, :7], mask[:, :7], 0))
        for t in range(7, 12):
            outs[i].append(run(layer, caches[i], x[:, t:t + 1], mask[:, t:t + 1], t))
    want, got = (torch.cat(o, dim=1) for o in outs)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].linear.recurrent, caches[0].linear.recurrent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].linear.conv, caches[0].linear.conv, rtol=1e-6, atol=1e-6)


def test_layer_rows_of_a_micro_batch_on_kernels():
    """HybridCacheRows hands out gathered copies: the kernels write them and the rows are written back."""
    ref, fast = kernel_layer(False)
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(4))
    full = torch.ones(3, 6, dtype=torch.bool)
    caches = [new_cache(ref, 3), new_cache(fast, 3)]
    rows = torch.tensor([2, 0])
    for layer, cache in zip((ref, fast), caches, strict=True):
        run(layer, cache, x[:, :5], full[:, :5], 0)
        part = cache.rows(rows)
        part.mark_valid(torch.arange(5, 6), full[:2, 5:])
        layer(x[rows, 5:], part)
    torch.testing.assert_close(caches[1].linear.recurrent, caches[0].linear.recurrent, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1].linear.conv, caches[0].linear.conv)


@torch.no_grad()
def test_custom_ops_under_torch_compile():
    """The decode step compiled (dynamo through torch.ops.moeflow.gdn_*, their state writes declared) gives the
    eager kernels' outputs and states; opcheck validates the ops' schemas and fake implementations."""
    _, fast = kernel_layer(True)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    eager, compiled = new_cache(fast, 2), new_cache(fast, 2)
    step = torch.compile(fast, backend="aot_eager", fullgraph=True)
    for cache in (eager, compiled):
        run(fast, cache, x[:, :4], mask[:, :4], 0)
    want = run(fast, eager, x[:, 4:], mask[:, 4:], 4)
    compiled.mark_valid(torch.arange(4, 5), mask[:, 4:])
    got = step(x[:, 4:], compiled)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(compiled.linear.recurrent, eager.linear.recurrent)
    assert torch.equal(compiled.linear.conv, eager.linear.conv)
    s = fast.shape
    qkv, a, b, state = decode_inputs(fast, 2, 1, torch.float32, seed=7)
    conv = torch.randn(2, s.conv_kernel - 1, s.conv_dim)
    m = torch.ones(2, 1, dtype=torch.bool)
    torch.library.opcheck(torch.ops.moeflow.gdn_conv_decode, (qkv, conv, fast.conv1d.weight, m))
    torch.library.opcheck(torch.ops.moeflow.gdn_recurrent, (qkv, a, b, fast.A_log, fast.dt_bias, m, state,
                                                            s.num_k_heads, s.k_head_dim, torch.float32))


def test_the_engine_gives_the_layers_its_kernel_choice(tmp_path):
    """kernels="triton" puts every Gated DeltaNet layer on the kernels, "torch" on the reference; the greedy tokens
    of a tiny Qwen3-Next (left-padded batch) are the same."""
    from tiny_hybrid import QWEN3_NEXT, make_checkpoint

    from moeflow import MoEModel

    path, _ = make_checkpoint(tmp_path, "qwen3_next", seed=11, **QWEN3_NEXT["interval2-gqa-dense-first"])
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    tokens, backends = [], []
    for kernels in ("torch", "triton"):
        model = MoEModel.from_pretrained(path, kernels=kernels)
        try:
            backends.append({m.kernels_backend for m in model.model.modules() if isinstance(m, GatedDeltaNet)})
            tokens.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=[]))
        finally:
            model.close()
    assert backends == [{"torch"}, {"triton"}]
    assert torch.equal(tokens[1], tokens[0])
