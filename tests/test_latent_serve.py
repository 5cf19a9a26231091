"""Continuous batching (moeflow serve's engine) on multi-head latent attention: DeepSeek-V3 and GLM-5 (DeepSeek
Sparse Attention, its indexer keys in the same latent vector) keep one latent vector per token in the slotted
cache (moeflow/engine/kv_slots.py). Chunked prefills, reused rows, decode passes of several rows at their own
positions, eager and through captured decode steps (test_compile_cuda_graphs' TraceCapture), all give each
request's tokens from generate() alone; a row costs the latent bytes, not full heads."""

from __future__ import annotations

import pytest
from engine_helpers import BUDGETS, assert_captured_serving_is_eager, generate_each, prompts, serve_all
from tiny_dsa import GLM_MOE_DSA, make_dsa_checkpoint
from tiny_families import DEEPSEEK_V3, make_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.engine.kv_slots import LatentSlotKVCache, SlotKVCache, row_bytes


def checkpoint(tmp_path, kind: str, seed: int):
    if kind == "deepseek_v3":
        return make_checkpoint(tmp_path, "deepseek_v3", seed=seed, **DEEPSEEK_V3["qlora-groups-dense"])[0]
    return make_dsa_checkpoint(tmp_path, "glm_moe_dsa", seed=seed, **GLM_MOE_DSA["shared-indexers-dense"])[0]


def serve(model, rows: int = 3, chunk: int = 5) -> list[list[int]]:
    # prompts() of up to 17 tokens pass GLM-5's index_topk (6 here): the sparse selection matters
    return serve_all(model, prompts(), BUDGETS, rows, chunk, cache_type=LatentSlotKVCache)


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=9)], ids=["resident", "lru"])
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa"])
def test_engine_tokens_equal_generate_alone(tmp_path, kind, offload):
    model = MoEModel.from_pretrained(checkpoint(tmp_path, kind, seed=13), kernels="torch", offload=offload)
    try:
        want = generate_each(model, prompts(), BUDGETS)
        assert serve(model) == want
        assert serve(model, rows=5, chunk=64) == want  # whole prompts in one right-padded prefill pass
    finally:
        model.close()


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa"])
def test_captured_engine_decode_gives_the_same_tokens(tmp_path, kind):
    path = checkpoint(tmp_path, kind, seed=14)
    assert_captured_serving_is_eager(path, serve)


def test_a_row_costs_the_latent_bytes(tmp_path):
    model = MoEModel.from_pretrained(checkpoint(tmp_path, "deepseek_v3", seed=1), kernels="torch")
    spec, cfg = model.family.kv_cache_spec(), model.config
    cache = SlotKVCache.for_model(model, 64, max_rows=2)
    assert cache.latent.shape == (cfg.num_hidden_layers, 2, 64, spec.latent_dim)
    assert row_bytes(model, 64) == cache.nbytes // 2 == cfg.num_hidden_layers * 64 * spec.latent_dim * 4
    padded = model.family.mla_shape().padded_head_dim
    full_heads = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * 64 * padded * 4  # what a row took before
    assert row_bytes(model, 64) * 5 < full_heads
