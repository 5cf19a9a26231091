"""The serving engine's prefix cache (moeflow/engine/prefix_cache.py): the placement rule on its own, then the
scripted scenario of tests/prefix_helpers.py (a multi-turn conversation, a shared system prompt, a strict prefix,
rows evicted while a request waits, a request copying a running row's prompt) through the engine on the embedded
Mixtral, resident and offloaded (lru), eager and through captured decode steps (test_compile_cuda_graphs'
TraceCapture): each request's tokens are those of greedy generate alone and of the engine without the cache, and
the prefill passes read only the tokens the cache did not hold."""

from __future__ import annotations

import pytest
import torch
from prefix_helpers import check_engine, generate_runner, run_engine, scenario, tokens
from test_serve_graphs import LRU, captured

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.prefix_cache import Placement, PrefixCache, common_prefix
from moeflow.families.base import LinearStateSpec


def test_common_prefix():
    a = list(range(100))
    assert common_prefix(a, a, 99) == 99 and common_prefix(a, a, 200) == 100
    for cut in (0, 1, 17, 63, 99):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix(a, b, 100) == cut and common_prefix(b, a, 10) == min(cut, 10)
    assert common_prefix(a, a[:40], 100) == 40 and common_prefix([], a, 5) == 0 and common_prefix(a, a, -1) == 0


def small_cache(rows: int = 3, linear: bool = False) -> SlotKVCache:
    spec = LinearStateSpec(num_layers=1, conv_kernel=4, conv_dim=8, v_heads=2, k_dim=4, v_dim=4) if linear else None
    return SlotKVCache(2, rows, 64, 2, 4, torch.float32, "cpu", spec)


def finish(prefix: PrefixCache, place: Placement, tokens: list[int]) -> None:
    """A sequence placed by ``place`` ran and left holding ``tokens``."""
    cache = prefix.cache
    row = cache.allocate(place.row, keep=place.reused if place.source is None else 0)
    if place.source is not None:
        cache.copy_prefix(place.source, row, place.reused)
    cache.valid[row, len(tokens):] = False
    cache.valid[row, :len(tokens)] = True
    cache.release(row)
    prefix.store(row, tokens)


def test_placement_takes_whole_rows_copies_shared_prefixes_and_evicts_the_least_recent():
    cache = small_cache(rows=3)
    prefix = PrefixCache(cache, min_tokens=4)
    sys_, conv = list(range(10)), list(range(10)) + [50, 51, 52]
    assert prefix.place(conv + [9]) == Placement(0)  # nothing cached: the lowest empty row
    finish(prefix, Placement(0), conv)
    assert prefix.held(0) == conv and prefix.rows == 1
    # turn 2 starts with all of row 0's tokens: the row is taken as it is
    assert prefix.place(conv + [53, 54]) == Placement(0, len(conv))
    finish(prefix, Placement(0, len(conv)), conv + [53])
    # a shared system prompt: copied into the lowest empty row; row 0 keeps its conversation
    other = sys_ + [70, 71]
    assert prefix.place(other) == Placement(1, 10, source=0)
    finish(prefix, Placement(1, 10, source=0), other)
    # the same prompt again: all but its last token (its logits give the first reply token), into the empty row
    assert prefix.place(other) == Placement(2, len(other) - 1, source=1)
    finish(prefix, Placement(2, len(other) - 1, source=1), other)
    assert list(prefix._held) == [0, 1, 2]  # least recent first
    # no empty row: a partial match (the most recent of equal ones: row 2) copies into the least recent idle row
    assert prefix.place(sys_ + [80]) == Placement(0, 10, source=2)
    assert prefix.held(0) is None and prefix.held(1) == other
    finish(prefix, Placement(0, 10, source=2), sys_ + [80])
    # a prefix shorter than min_tokens reuses nothing; the least recent idle row is evicted
    assert prefix.place([90, 90, 90, 1]) == Placement(1) and prefix.held(1) is None
    finish(prefix, Placement(1), [90, 90, 90, 1])
    # when the least recent idle row is the source itself, it keeps the prefix (no copy)
    assert list(prefix._held) == [2, 0, 1]
    assert prefix.place(other[:11] + [77]) == Placement(2, 11)
    assert cache.allocate(2, keep=11) == 2  # (the engine hands it out: row 2 runs)
    # a running row is a copy source for a concurrent request with the same prompt start
    assert prefix.place(list(range(30, 60)), running=[(2, list(range(30, 50)))]) == Placement(0, 20, source=2)
    assert (prefix.lookups, prefix.hits) == (8, 6)


def test_hybrid_rows_are_reused_only_whole():
    prefix = PrefixCache(small_cache(rows=2, linear=True), min_tokens=4)
    held = list(range(12))
    assert prefix.place(held + [1]) == Placement(0)
    finish(prefix, Placement(0), held)
    assert prefix.place(held[:8] + [99, 98]) == Placement(1)  # a part of the row: its state holds all 12 tokens
    assert prefix.place(held) == Placement(1)  # the same tokens: the last must be computed, so not whole
    assert prefix.place(held + [1]) == Placement(0, 12)  # the whole row, then at least one token computed
    assert prefix.cache.allocate(0, keep=12) == 0
    assert prefix.place(held + [1], running=[(0, held)]) == Placement(1)  # running rows: never a source
    with pytest.raises(ValueError, match="linear-attention states"):
        prefix.cache.copy_prefix(0, 1, 4)


def test_kept_and_copied_prefixes_leave_exact_validity_and_keys():
    cache = small_cache(rows=3)
    cache.k.normal_()
    cache.v.normal_()
    cache.valid[:, :40] = True
    keys = cache.k[:, 0, :, :25].clone()
    assert cache.allocate(1, keep=25) == 1
    assert cache.valid[1].tolist() == [i < 25 for i in range(64)]
    assert cache.allocate(2) == 2 and not cache.valid[2].any()
    cache.copy_prefix(1, 2, 20)
    assert cache.valid[2].tolist() == [i < 20 for i in range(64)]
    assert torch.equal(cache.k[:, 2, :, :20], cache.k[:, 1, :, :20])
    assert torch.equal(cache.v[:, 2, :, :20], cache.v[:, 1, :, :20])
    assert torch.equal(cache.k[:, 0, :, :25], keys)  # the source untouched
    with pytest.raises(ValueError, match="not a free row"):
        cache.allocate(1)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """The scenario's requests each alone through greedy generate, all experts resident."""
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    try:
        return tokens(scenario(generate_runner(model), model.config.vocab_size))
    finally:
        model.close()


@pytest.mark.parametrize("offload", [None, LRU], ids=["resident", "lru"])
def test_engine_with_the_prefix_cache_gives_generates_tokens(offload, reference):
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch", offload=offload)
    try:
        off, prefilled_off = run_engine(model, SlotKVCache.for_model(model, 256, max_rows=3), prefix_cache=False)
        check_engine(model, SlotKVCache.for_model(model, 256, max_rows=3), reference, whole_rows_only=False)
    finally:
        model.close()
    assert tokens(off) == reference  # and without the cache: nothing reused, every prompt token prefilled
    assert all(c == 0 for _, _, c in off.values()) and prefilled_off == sum(len(p) for p, _, _ in off.values())


@pytest.mark.parametrize("offload", [None, LRU], ids=["resident", "lru"])
def test_captured_decode_with_the_prefix_cache_gives_generates_tokens(offload, reference):
    model, graphs = captured(offload)
    try:
        check_engine(model, SlotKVCache.for_model(model, 256, max_rows=3), reference, whole_rows_only=False)
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures > 0
