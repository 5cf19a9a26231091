"""The prefix cache on the families whose rows are not plain keys and values (tests/prefix_helpers.py's scenario):
hybrid linear attention (Qwen3-Next, Qwen3.5-MoE), whose per-row recurrent states reflect every token a row has seen,
reuse only whole idle rows (a multi-turn conversation's next turn) and nothing else; multi-head latent attention
(DeepSeek-V3, GLM-5 with its indexer keys in the latent vector) copies and keeps latent prefixes as full heads do.
Eager and captured decode (test_compile_cuda_graphs' TraceCapture), resident and lru: each request's tokens are
those of greedy generate alone, and the prefill passes read only what the cache did not hold."""

from __future__ import annotations

import pytest
import torch
from prefix_helpers import check_engine, generate_runner, scenario, tokens
from test_compile_cuda_graphs import HostArgs, TraceCapture, on_device
from tiny_dsa import GLM_MOE_DSA, make_dsa_checkpoint
from tiny_families import DEEPSEEK_V3
from tiny_families import make_checkpoint as make_family_checkpoint
from tiny_hybrid import QWEN3_5_MOE, QWEN3_NEXT
from tiny_hybrid import make_checkpoint as make_hybrid_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.engine.kv_slots import SlotKVCache

LRU = OffloadConfig(policy="lru", gpu_expert_slots=9)
HYBRID = {"qwen3_next", "qwen3_5_moe"}


def checkpoint(tmp_path, kind: str):
    if kind == "qwen3_next":
        return make_hybrid_checkpoint(tmp_path, kind, seed=21, **QWEN3_NEXT["interval2-gqa-dense-first"])[0]
    if kind == "qwen3_5_moe":
        return make_hybrid_checkpoint(tmp_path, kind, seed=21, **QWEN3_5_MOE["full-first-mrope"])[0]
    if kind == "deepseek_v3":
        return make_family_checkpoint(tmp_path, kind, seed=21, **DEEPSEEK_V3["qlora-groups-dense"])[0]
    return make_dsa_checkpoint(tmp_path, kind, seed=21, **GLM_MOE_DSA["shared-indexers-dense"])[0]


def reference(path) -> dict[str, list[int]]:
    model = MoEModel.from_pretrained(path, kernels="torch")
    try:
        return tokens(scenario(generate_runner(model), model.config.vocab_size))
    finally:
        model.close()


@pytest.mark.parametrize("kind,offload", [("qwen3_next", None), ("qwen3_next", LRU), ("qwen3_5_moe", None),
                                          ("deepseek_v3", None), ("deepseek_v3", LRU), ("glm_moe_dsa", None)])
def test_engine_with_the_prefix_cache_gives_generates_tokens(tmp_path, kind, offload):
    path = checkpoint(tmp_path, kind)
    want = reference(path)
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    try:
        check_engine(model, SlotKVCache.for_model(model, 256, max_rows=3), want, whole_rows_only=kind in HYBRID)
    finally:
        model.close()


@pytest.mark.parametrize("kind", ["qwen3_next", "deepseek_v3"])
def test_captured_decode_with_the_prefix_cache_gives_generates_tokens(tmp_path, kind):
    path = checkpoint(tmp_path, kind)
    want = reference(path)
    model = MoEModel.from_pretrained(path, kernels="torch")
    graphs = model.capture_decode(capture_factory=TraceCapture)
    inner = on_device(model.model)
    graphs.inner = lambda *args: inner(*args).as_subclass(torch.Tensor)
    model.use_backend(HostArgs(model.experts))
    try:
        check_engine(model, SlotKVCache.for_model(model, 256, max_rows=3), want, whole_rows_only=kind in HYBRID)
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures > 0
