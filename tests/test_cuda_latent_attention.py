"""MLA's in-place decode attention kernel compiled on a lent GPU, at DeepSeek-V3's shapes (128 heads, kv_lora_rank
512 + rope 64, 16 rows, 4096 keys, bf16) and GLM-5's (64 heads, DSA's selection, the indexer key after the latent):

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_latent_attention.py

The kernel against its fp32 reference (bf16: 2e-2, the probabilities rounded to bf16 for the value dot), the same
bits on every launch, ``LatentSlotDecodeView.attend_latent`` on by default on CUDA and within tolerance of the
view's gather + mask + ``LatentAttention.absorbed`` arithmetic, and a decode layer's write + attend captured as a
CUDA graph replaying the eager call's bits (latents written by the replay, not the capture). Skipped without CUDA,
and under the interpreter. No timing here: the GPU timing against the gather is owed (docs/kernels.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from moeflow.engine.kv_slots import LatentSlotKVCache
from moeflow.kernels.attention.latent import latent_attention, latent_attention_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the lane checks the compiled kernels"),
]

BF16 = dict(rtol=0, atol=2e-2)
ROWS, KEYS, RANK, ROPE = 16, 4096, 512, 64
SHAPES = {"deepseek-v3": (128, 0, False), "glm-5": (64, 128, True)}  # heads, indexer columns, DSA selection
SCALE = 0.1352  # DeepSeek-V3's 192 ** -0.5 x YaRN's mscale ** 2 (factor 40, mscale_all_dim 1)


def cache_inputs(heads: int, extra: int = 0, seed: int = 0):
    """One layer's latents [16, 4096, 576 + extra] with holes in ``valid``, 16 queries over the rows in another order
    with two padding copies, positions across the row (the last at 4095), a selection keeping each query's key."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latents = torch.randn(ROWS, KEYS, RANK + ROPE + extra, device="cuda", generator=gen).bfloat16()
    valid = torch.rand(ROWS, KEYS, device="cuda", generator=gen) > 0.1
    rows = torch.tensor([5, 3, 15, 0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 5, 3], device="cuda")
    pos = torch.randint(0, KEYS, (ROWS, 1), device="cuda", generator=gen)
    pos[0] = KEYS - 1
    pos[14], pos[15] = pos[0], pos[1]  # the padding copies sit where their tokens sit
    query = torch.randn(ROWS, heads, 1, RANK + ROPE, device="cuda", generator=gen).bfloat16()
    query[14], query[15] = query[0], query[1]
    select = torch.rand(ROWS, KEYS, device="cuda", generator=gen) > 0.5
    select[torch.arange(ROWS, device="cuda"), pos[:, 0]] = True
    select[14], select[15] = select[0], select[1]
    return query, latents, rows, valid, pos, select


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_kernel_equals_the_reference_and_repeats_its_bits(model):
    heads, extra, sparse = SHAPES[model]
    query, latents, rows, valid, pos, select = cache_inputs(heads, extra)
    select = select if sparse else None
    got = latent_attention(query, latents, rows, valid, pos, KEYS, RANK, SCALE, select)
    want = latent_attention_reference(query, latents, rows, valid, pos, KEYS, RANK, SCALE, select)
    assert got.dtype == torch.bfloat16 and got.shape == (ROWS, heads, 1, RANK)
    torch.testing.assert_close(got.float(), want, **BF16)
    assert torch.equal(got[14], got[0]) and torch.equal(got[15], got[1])
    for _ in range(20):  # no atomics, the splits merged in a fixed order: the same bits every launch
        assert torch.equal(latent_attention(query, latents, rows, valid, pos, KEYS, RANK, SCALE, select), got)


def test_the_views_attend_latent_is_on_by_default_and_captured_replays_its_bits():
    heads = 128
    cache = LatentSlotKVCache(2, ROWS, KEYS, RANK + ROPE, torch.bfloat16, "cuda")
    query, latents, rows, valid, pos, _ = cache_inputs(heads, seed=1)
    cache.latent[1].copy_(latents)
    cache.valid.copy_(valid)
    view = cache.decode_view(ROWS, KEYS)
    view.load(rows, torch.tensor(list(range(14)) + [0, 1], device="cuda"))
    new = torch.randn(ROWS, 1, RANK + ROPE, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    new = new.bfloat16()
    view.mark_valid(pos, torch.ones_like(pos, dtype=torch.bool))
    assert view.latent_in_place(query)  # "auto": the kernel on CUDA
    view.write_latent(1, new, pos)
    eager = view.attend_latent(1, query, pos, RANK, SCALE)
    gathered = view.update_latent(1, new, pos)  # the torch path's arithmetic (LatentAttention.absorbed)
    scores = torch.matmul(query, gathered[:, None].transpose(-1, -2)).float() * SCALE
    probs = scores.masked_fill(~view.attention_mask(pos, None), float("-inf")).softmax(dim=-1).bfloat16()
    torch.testing.assert_close(eager.float(), torch.matmul(probs, gathered[:, None, :, :RANK]).float(), **BF16)

    def step() -> torch.Tensor:
        view.write_latent(1, new, pos)
        return view.attend_latent(1, query, pos, RANK, SCALE)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    cache.latent[1][rows[:, None], pos] = 0  # the replay writes the latents again before reading them
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
