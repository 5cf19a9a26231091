"""Continuous batching (moeflow serve's engine) on hybrid models (Qwen3-Next / Qwen3.5: linear-attention states kept
per cache row beside the attention layers' keys and values): chunked prefills (a chunk goes on from the state the
row's last chunk left, its right padding leaves the state alone), rows reused by waiting requests (their states start
at zero), decode passes of several rows at their own positions, eager and through captured decode steps
(test_compile_cuda_graphs' TraceCapture: padded batches whose copies write their source's state), all give each
request's tokens from generate() alone."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import BUDGETS, assert_captured_serving_is_eager, generate_each, prompts, serve_all
from tiny_hybrid import QWEN3_5_MOE, QWEN3_NEXT, make_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.engine.continuous import ContinuousEngine
from moeflow.engine.kv_slots import SlotKVCache

CASES = {"qwen3_next": QWEN3_NEXT["interval2-gqa-dense-first"], "qwen3_5_moe": QWEN3_5_MOE["full-first-mrope"]}
def serve(model, rows: int = 3, chunk: int = 5) -> list[list[int]]:
    return serve_all(model, prompts(), BUDGETS, rows, chunk)


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=9)], ids=["resident", "lru"])
@pytest.mark.parametrize("kind", list(CASES))
def test_engine_tokens_equal_generate_alone(tmp_path, kind, offload):
    path, _ = make_checkpoint(tmp_path, kind, seed=13, **CASES[kind])
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    try:
        want = generate_each(model, prompts(), BUDGETS)
        assert serve(model) == want
        assert serve(model, rows=5, chunk=64) == want  # whole prompts in one right-padded prefill pass
    finally:
        model.close()


@pytest.mark.parametrize("kind", list(CASES))
def test_captured_engine_decode_gives_the_same_tokens(tmp_path, kind):
    path, _ = make_checkpoint(tmp_path, kind, seed=14, **CASES[kind])
    assert_captured_serving_is_eager(path, serve)


def test_a_cache_without_linear_states_is_refused_by_name(tmp_path):
    path, _ = make_checkpoint(tmp_path, "qwen3_next", **CASES["qwen3_next"])
    model = MoEModel.from_pretrained(path)
    cache = SlotKVCache(2, 2, 64, 2, 16, torch.float32, "cpu")  # keys and values only
    with pytest.raises(ValueError, match="qwen3_next: .*linear-attention layers keep a state"):
        ContinuousEngine(model, cache)
