"""The Gated DeltaNet kernels compiled on a lent GPU, at Qwen3-Next-80B's linear-attention shapes (16 key heads,
32 value heads, dk = dv = 128, conv kernel 4, bf16 activations):

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_deltanet.py

The decode conv and the fused recurrence against the fp32 torch references (GatedDeltaNet.conv,
rule_inputs + recurrent_gated_delta_rule, chunk_gated_delta_rule for a prompt), a finished row's states bitwise
unchanged, the same bits on every launch, and a decode step captured as a CUDA graph replaying the eager step's
outputs and states. Skipped without CUDA, and under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

from moeflow.families.gated_deltanet import (
    DeltaNetShape,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the lane checks the compiled kernels"),
]

HK, HV, DK, DV, KW, HIDDEN = 16, 32, 128, 128, 4, 2048  # Qwen3-Next-80B-A3B's linear attention (hidden 2048)


@pytest.fixture(scope="module")
def layer() -> GatedDeltaNet:
    shape = DeltaNetShape(HIDDEN, HK, HV, DK, DV, KW, fused_projections=True)
    gen = torch.Generator().manual_seed(0)
    mod = GatedDeltaNet(shape, 0, lambda n, i, o: torch.nn.Linear(i, o, bias=False, dtype=torch.bfloat16),
                        torch.bfloat16)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if "proj" in name else 0.3))
    return mod.cuda()


def inputs(layer: GatedDeltaNet, rows: int, t: int, seed: int):
    s = layer.shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(rows, t, s.conv_dim, device="cuda", generator=gen).bfloat16()
    a, b = (torch.randn(rows, t, HV, device="cuda", generator=gen).bfloat16() for _ in range(2))
    state = torch.randn(rows, HV, DK, DV, device="cuda", generator=gen) * 0.1
    return qkv, a, b, state


@pytest.mark.parametrize("rows", [1, 8])
def test_decode_kernels_equal_the_references(layer, rows):
    from moeflow.kernels import deltanet

    qkv, a, b, state = inputs(layer, rows, 1, seed=rows)
    conv_state = torch.randn(rows, KW - 1, layer.shape.conv_dim, device="cuda").bfloat16()
    mask = torch.ones(rows, 1, dtype=torch.bool, device="cuda")
    mask[-1] = False  # a finished row
    want_qkv, want_conv = layer.conv(qkv, conv_state.clone(), mask)
    q, k, v, g, beta = layer.rule_inputs(want_qkv, a, b, mask)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got_conv, got_state = conv_state.clone(), state.clone()
    got_qkv = deltanet.conv_decode(qkv, got_conv, layer.conv1d.weight, mask)
    got = deltanet.recurrent(want_qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, HK, DK, torch.float32)
    torch.testing.assert_close(got_qkv, want_qkv, rtol=1e-2, atol=1e-2)  # one bf16 ulp (conv sum order)
    assert torch.equal(got_conv, want_conv)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_state[-1], state[-1]) and torch.equal(got_conv[-1], conv_state[-1])
    for _ in range(20):  # no atomics, no split reductions: the same bits every launch
        again = state.clone()
        assert torch.equal(deltanet.recurrent(want_qkv, a, b, layer.A_log, layer.dt_bias, mask, again, HK, DK,
                                              torch.float32), got)
        assert torch.equal(again, got_state)


def test_prompt_equals_the_chunked_reference(layer):
    from moeflow.kernels import deltanet

    qkv, a, b, state = inputs(layer, 2, 300, seed=7)
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[1, :40] = False
    q, k, v, g, beta = layer.rule_inputs(qkv, a, b, mask)
    assert not torch.backends.cuda.matmul.allow_tf32  # the reference's matmuls in fp32
    want, want_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    got_state = state.clone()
    got = deltanet.recurrent(qkv, a, b, layer.A_log, layer.dt_bias, mask, got_state, HK, DK, torch.float32)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-4)


def test_captured_decode_step_replays_the_eager_step(layer):
    """The layer's decode step on the kernels (conv state and recurrent state written in place) as a CUDA graph."""
    from moeflow.engine.linear_state import HybridKVCache
    from moeflow.families.base import LinearStateSpec

    s = layer.shape
    layer.use_kernels("triton")
    spec = LinearStateSpec(1, s.conv_dim, KW, HV, DK, DV)
    caches = [HybridKVCache(0, 4, 16, 1, 8, spec, torch.bfloat16, "cuda") for _ in range(2)]
    x = torch.randn(4, 1, HIDDEN, device="cuda").bfloat16()
    mask = torch.tensor([[True], [True], [False], [True]], device="cuda")
    for cache in caches:
        cache.linear.recurrent.normal_(0, 0.1, generator=torch.Generator(device="cuda").manual_seed(3))
        cache.mark_valid(torch.arange(0, 1, device="cuda"), mask)
    with torch.no_grad():
        want = layer(x, caches[0])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        restore = caches[1].snapshot()
        with torch.cuda.stream(stream):
            layer(x, caches[1])  # warm-up (compiles the kernels)
            restore()
            with torch.cuda.graph(graph, stream=stream):
                got = layer(x, caches[1])
        torch.cuda.current_stream().wait_stream(stream)
        restore()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(caches[1].linear.recurrent, caches[0].linear.recurrent)
    assert torch.equal(caches[1].linear.conv, caches[0].linear.conv)
