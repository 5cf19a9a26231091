"""The per-token glue of a CPU decode step made cheaper without changing a bit: the one-query attention mask
(engine/kv_cache.py) and the memo of one position's rotary (cos, sin) (families/layers.py). <1 s."""

from __future__ import annotations

import torch

from moeflow.engine.kv_cache import attention_mask
from moeflow.families.layers import RotaryEmbedding


def _general(valid: torch.Tensor, cache_position: torch.Tensor, window: int | None) -> torch.Tensor:
    """The formula for any number of queries (attention_mask's own, T > 1)."""
    keys = torch.arange(valid.shape[1])
    q = cache_position[:, None]
    allowed = (keys[None, :] <= q)[None] & valid[:, None, :]
    if window is not None:
        allowed = allowed & (q - keys[None, :] < window)[None]
    return (allowed | (keys[None, :] == q)[None])[:, None]


def test_the_one_query_mask_is_the_general_formula():
    g = torch.Generator().manual_seed(0)
    for b in (1, 2):
        for length in (1, 7, 64):
            valid = torch.rand((b, length), generator=g) < 0.7
            for pos in range(length):
                for window in (None, 1, 3, 100):
                    got = attention_mask(valid, torch.tensor([pos]), window)
                    assert got.dtype == torch.bool and got.is_contiguous()
                    assert torch.equal(got, _general(valid, torch.tensor([pos]), window)), (b, length, pos, window)
    # two queries at once: the general path itself
    valid = torch.ones((1, 8), dtype=torch.bool)
    assert torch.equal(attention_mask(valid, torch.tensor([3, 4]), None), _general(valid, torch.tensor([3, 4]), None))


def test_one_position_rotary_is_computed_once_with_the_same_bits():
    rot = RotaryEmbedding(64, 10000.0)
    for pos in (0, 1, 17, 4095):
        for dtype in (torch.float32, torch.bfloat16):
            ids = torch.tensor([[pos]])
            first = rot(ids, dtype)
            again = rot(ids, dtype)
            assert again[0] is first[0] and again[1] is first[1]  # kept
            ref = rot._compute(ids, dtype)
            assert first[0].dtype == dtype and first[0].shape == (1, 1, 64)
            assert torch.equal(first[0], ref[0]) and torch.equal(first[1], ref[1])
            # a row of a longer pass: the same numbers as the one-position call
            row = rot(torch.tensor([[pos, pos + 1]]), dtype)
            assert torch.equal(row[0][:, :1], first[0]) and torch.equal(row[1][:, :1], first[1])


def test_greedy_next_tokens_on_the_cpu_are_torch_argmax():
    from moeflow.engine.sampling import GenerationConfig, next_tokens

    g = torch.Generator().manual_seed(1)
    logits = torch.randn((4, 1000), generator=g)
    logits[1, 10] = logits[1, 500] = 100.0  # a tie: the first
    logits[2, 7] = float("nan")  # NaN counts as the largest, as in torch
    logits[3] = float("-inf")
    got = next_tokens(logits, GenerationConfig(), None)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert got.tolist()[1:] == [10, 7, 0]
