"""The gated delta rule (moeflow.families.gated_deltanet) in fp32: the chunked prefill form equals the token-by-token
recurrence (several chunks, a ragged tail, a starting state, masked tokens), and a Gated DeltaNet layer over the
engine's hybrid cache gives the same outputs and states for one pass of N tokens as for a prefill of some of them
followed by one-token decode steps (both projection layouts, left padding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.engine.linear_state import HybridKVCache
from moeflow.families.base import LinearStateSpec
from moeflow.families.gated_deltanet import (
    DeltaNetShape,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)


def rule_inputs(b: int, h: int, t: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, h, t, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(b, h, t, dk, generator=gen))
    v = torch.randn(b, h, t, dv, generator=gen)
    g = -torch.rand(b, h, t, generator=gen) * 0.5  # decays exp(g) in (0.6, 1]
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("t", "chunk"), [(1, 64), (37, 64), (150, 64), (40, 8)])
def test_chunked_rule_equals_the_recurrence(t, chunk):
    q, k, v, g, beta, state = rule_inputs(2, 3, t, 8, 12, seed=t)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    assert got.shape == want.shape == (2, 3, t, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_masked_tokens_leave_the_state_unchanged():
    """g = beta = 0 (a padding token) keeps the state exactly; the real tokens around it see the same state."""
    q, k, v, g, beta, state = rule_inputs(1, 2, 20, 8, 8, seed=5)
    pad = torch.zeros(20, dtype=torch.bool)
    pad[[0, 1, 7, 19]] = True
    g_m, beta_m = g.masked_fill(pad, 0.0), beta.masked_fill(pad, 0.0)
    out, end = chunk_gated_delta_rule(q, k, v, g_m, beta_m, state, chunk=8)
    real = ~pad
    want, want_end = recurrent_gated_delta_rule(q[:, :, real], k[:, :, real], v[:, :, real], g[:, :, real],
                                                beta[:, :, real], state)
    torch.testing.assert_close(out[:, :, real], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end, want_end, rtol=1e-5, atol=1e-5)
    _, same = recurrent_gated_delta_rule(q[:, :, :2], k[:, :, :2], v[:, :, :2], g_m[:, :, :2], beta_m[:, :, :2],
                                         state)
    assert torch.equal(same, state)


def make_layer(fused: bool, seed: int = 0) -> GatedDeltaNet:
    shape = DeltaNetShape(hidden_size=32, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=6, conv_kernel=4,
                          fused_projections=fused)
    layer = GatedDeltaNet(shape, 0, lambda name, i, o: torch.nn.Linear(i, o, bias=False), torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.3 if "proj" in name or "conv" in name else 0.5)
    return layer


def new_cache(layer: GatedDeltaNet, batch: int) -> HybridKVCache:
    s = layer.shape
    spec = LinearStateSpec(1, s.conv_dim, s.conv_kernel, s.num_v_heads, s.k_head_dim, s.v_head_dim)
    return HybridKVCache(0, batch, 32, 1, 4, spec, torch.float32, "cpu")


def run(layer: GatedDeltaNet, cache: HybridKVCache, x: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """One pass of x [B, T, H] at cache positions start.. with token mask [B, T]."""
    cache.mark_valid(torch.arange(start, start + x.shape[1]), mask)
    return layer(x, cache)


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("prefill", [1, 2, 5, 11])
def test_prefill_then_decode_equals_one_pass(fused, prefill):
    layer = make_layer(fused)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(prefill))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    one = new_cache(layer, 2)
    want = run(layer, one, x, mask, 0)
    steps = new_cache(layer, 2)
    outs = [run(layer, steps, x[:, :prefill], mask[:, :prefill], 0)]
    for t in range(prefill, 12):
        outs.append(run(layer, steps, x[:, t:t + 1], mask[:, t:t + 1], t))
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps.linear.recurrent, one.linear.recurrent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps.linear.conv, one.linear.conv, rtol=1e-5, atol=1e-5)  # (projections of T rows)


def test_a_row_without_real_tokens_keeps_its_states():
    """A finished row in a decode step (its token not real) changes neither its conv nor its recurrent state."""
    layer = make_layer(False, seed=1)
    cache = new_cache(layer, 2)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(9))
    run(layer, cache, x, torch.ones(2, 6, dtype=torch.bool), 0)
    conv, recurrent = cache.linear.conv.clone(), cache.linear.recurrent.clone()
    run(layer, cache, x[:, :1], torch.tensor([[True], [False]]), 6)
    assert torch.equal(cache.linear.conv[:, 1], conv[:, 1]) and torch.equal(cache.linear.recurrent[:, 1],
                                                                              recurrent[:, 1])
    assert not torch.equal(cache.linear.recurrent[:, 0], recurrent[:, 0])


def test_the_conv_state_is_the_last_inputs_before_the_next_token():
    """The conv over [state, new inputs] equals the zero-padded causal conv over the whole sequence."""
    layer = make_layer(False, seed=2)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(2))
    qkv = layer.project(x)[0]
    w = layer.conv1d.weight
    want = F.silu(F.conv1d(F.pad(qkv.transpose(1, 2), (3, 0)), w, groups=w.shape[0])).transpose(1, 2)
    state = torch.zeros(1, 3, layer.shape.conv_dim)
    first, state = layer.conv(qkv[:, :5], state, torch.ones(1, 5, dtype=torch.bool))
    second, _ = layer.conv(qkv[:, 5:], state, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(torch.cat((first, second), dim=1), want, rtol=1e-6, atol=1e-6)
