"""The slot decode attention kernel compiled on a lent GPU, at Mixtral-8x7B's shapes (32 heads, 8 kv heads, D 128,
16 rows, 4096 keys, bf16) and gpt-oss-120b's (64 heads, 8 kv heads, D 64, sinks, a sliding window of 128):

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_slot_attention.py

The kernel against its fp32 reference (bf16: 2e-2, the probabilities rounded to bf16 for the value dot), the same
bits on every launch, ``SlotDecodeView.attend`` on by default on CUDA and within tolerance of the view's gather +
mask + SDPA path, and a decode layer's attend captured as a CUDA graph replaying the eager call's bits (keys
written by the replay, not the capture). Skipped without CUDA, and under the interpreter. No timing here: the
GPU timing against the gather is owed (docs/kernels.md).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from moeflow.engine.kv_slots import SlotKVCache
from moeflow.kernels.attention.slot import slot_attention, slot_attention_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the lane checks the compiled kernels"),
]

BF16 = dict(rtol=0, atol=2e-2)
ROWS, KEYS = 16, 4096
SHAPES = {"mixtral-8x7b": (32, 8, 128, None, False), "gpt-oss-120b": (64, 8, 64, 128, True)}


def cache_inputs(heads: int, kv_heads: int, d: int, seed: int = 0):
    """One layer's K/V [16, kv_heads, 4096, D] with holes in ``valid``, 16 queries over the rows in another
    order with two padding copies, positions across the row (the last at 4095)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(ROWS, kv_heads, KEYS, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(ROWS, kv_heads, KEYS, d, device="cuda", generator=gen).bfloat16()
    valid = torch.rand(ROWS, KEYS, device="cuda", generator=gen) > 0.1
    rows = torch.tensor([5, 3, 15, 0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 5, 3], device="cuda")
    pos = torch.randint(0, KEYS, (ROWS, 1), device="cuda", generator=gen)
    pos[0] = KEYS - 1
    pos[14], pos[15] = pos[0], pos[1]  # the padding copies sit where their tokens sit
    q = torch.randn(ROWS, heads, 1, d, device="cuda", generator=gen).bfloat16()
    q[14], q[15] = q[0], q[1]
    return q, k, v, rows, valid, pos


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_kernel_equals_the_reference_and_repeats_its_bits(model):
    heads, kv_heads, d, window, with_sinks = SHAPES[model]
    q, k, v, rows, valid, pos = cache_inputs(heads, kv_heads, d)
    sinks = torch.randn(heads, device="cuda").bfloat16() if with_sinks else None
    got = slot_attention(q, k, v, rows, valid, pos, KEYS, window, sinks)
    want = slot_attention_reference(q, k, v, rows, valid, pos, KEYS, window, sinks)
    assert got.dtype == torch.bfloat16 and got.shape == (ROWS, heads, 1, d)
    torch.testing.assert_close(got.float(), want, **BF16)
    assert torch.equal(got[14], got[0]) and torch.equal(got[15], got[1])
    for _ in range(20):  # no atomics, the splits merged in a fixed order: the same bits every launch
        assert torch.equal(slot_attention(q, k, v, rows, valid, pos, KEYS, window, sinks), got)


def test_the_views_attend_is_on_by_default_and_captured_replays_its_bits():
    heads, kv_heads, d = 32, 8, 128
    cache = SlotKVCache(2, ROWS, KEYS, kv_heads, d, torch.bfloat16, "cuda")
    q, k_rows, v_rows, rows, valid, pos = cache_inputs(heads, kv_heads, d, seed=1)
    cache.k[1].copy_(k_rows)
    cache.v[1].copy_(v_rows)
    cache.valid.copy_(valid)
    view = cache.decode_view(ROWS, KEYS)
    view.load(rows, torch.tensor(list(range(14)) + [0, 1], device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(2)
    k, v = (torch.randn(ROWS, kv_heads, 1, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    view.mark_valid(pos, torch.ones_like(pos, dtype=torch.bool))
    eager = view.attend(1, q, k, v, pos, None)
    assert eager is not None  # "auto": the kernel on CUDA
    k_all, v_all = view.update(1, k, v, pos)
    sdpa = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=view.attention_mask(pos, None), enable_gqa=True)
    torch.testing.assert_close(eager.float(), sdpa.float(), **BF16)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        view.attend(1, q, k, v, pos, None)
        with torch.cuda.graph(graph, stream=stream):
            captured = view.attend(1, q, k, v, pos, None)
    torch.cuda.current_stream().wait_stream(stream)
    r, p = rows[:, None], pos
    cache.k[1][r, :, p] = 0  # the replay writes the keys again before reading them
    cache.v[1][r, :, p] = 0
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
