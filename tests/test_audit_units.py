"""Small tests for four survivors of issue 35's bug audit (each listed in scripts/mutation_check.py): stop strings
cut at the earliest one in the text, LRU's per-layer order refreshed by a gate access, the repetition penalty over
the prompt too (transformers' processor), and a hybrid model's memory plan holding its linear-attention states."""

from __future__ import annotations

import random

import pytest
import torch

from moeflow.engine.sampling import adjust_logits
from moeflow.offload.eviction import LRU
from moeflow.serve.text import TextAssembler

# ---------------------------------------------------------------------------------------------------------
# stop strings (moeflow/serve/text.py)


def _decode(ids: list[int]) -> str:  # a byte-level vocabulary, as the embedded model's
    return bytes(ids).decode("utf-8", errors="replace")


def test_the_text_is_cut_at_the_earliest_stop_string_not_the_first_listed():
    """Two stops, the later-listed one first in the text: the reply ends before it, whole and streamed."""
    ids = list(b"abc STOP def END ghi")
    a = TextAssembler(_decode, ["END", "STOP"], set())
    assert a.text(ids) == "abc "
    streamed = TextAssembler(_decode, ["END", "STOP"], set())
    deltas = [streamed.delta(ids[: i + 1], final=False) for i in range(len(ids))] + [streamed.delta(ids, True)]
    assert "".join(deltas) == "abc "


# ---------------------------------------------------------------------------------------------------------
# LRU recency (moeflow/offload/eviction.py): the global order and the per-layer order (per-layer quotas)


def test_a_gate_access_makes_an_expert_recent_in_its_layers_order():
    lru = LRU()
    for key in [(0, 0), (0, 1), (0, 2), (1, 0)]:
        lru.loaded(key)
    lru.access((0, 0))  # re-accessed: now the layer's most recent
    evictable = {(0, 0), (0, 1), (0, 2), (1, 0)}
    assert lru.pick_in_layer(evictable, 0, 0) == (0, 1)
    assert lru.pick(evictable, 0) == (0, 1)
    lru.access((0, 1))
    assert lru.pick_in_layer(evictable, 0, 0) == (0, 2)


def test_lru_picks_agree_with_the_last_use_order_over_random_traffic():
    """Loads, gate accesses (hits and misses) and evictions at random: ``pick`` and ``pick_in_layer`` return the
    evictable key used longest ago (``last_use``, stamped by the same calls) overall and in the layer."""
    rng = random.Random(0)
    lru = LRU()
    resident: set[tuple[int, int]] = set()
    for _ in range(400):
        key = (rng.randrange(3), rng.randrange(6))
        op = rng.random()
        if op < 0.5:
            lru.access(key)
        elif key not in resident:
            lru.loaded(key)
            resident.add(key)
        elif op > 0.9:
            lru.evicted(key)
            resident.discard(key)
        if not resident:
            continue
        evictable = {k for k in resident if rng.random() < 0.8}
        if evictable:
            assert lru.pick(evictable, 0) == min(evictable, key=lambda k: lru.last_use[k])
        for layer in range(3):
            own = [k for k in evictable if k[0] == layer]
            want = min(own, key=lambda k: lru.last_use[k]) if own else None
            assert lru.pick_in_layer(evictable, 0, layer) == want


# ---------------------------------------------------------------------------------------------------------
# the repetition penalty (moeflow/engine/sampling.py): over the prompt and the reply, as transformers'


@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_the_repetition_penalty_covers_the_prompts_tokens(penalty):
    """transformers' RepetitionPenaltyLogitsProcessor penalises every token of ``input_ids`` (prompt + generated);
    here a prompt token holds the largest logit (the smallest for a penalty < 1), so it decides the argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0))
    prompt, generated = [7, 3, 7, 11], [20, 3]
    logits[0, 7] = 4.0 if penalty > 1 else -4.0  # a prompt-only token
    logits[0, 25] = 3.0 if penalty > 1 else -3.0  # an unseen runner-up
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), logits.clone())
    got = adjust_logits(logits, prompt, generated, (), penalty, 0.0, 0.0)
    assert torch.equal(got, want)
    pick = torch.argmax if penalty > 1 else torch.argmin
    assert int(pick(logits)) == 7 and int(pick(got)) == 25  # the penalty on the prompt token decides


# ---------------------------------------------------------------------------------------------------------
# the memory plan of a hybrid (Qwen3-Next) model (moeflow/engine/memory.py)


def _tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_hybrid_models_plan_holds_its_linear_attention_states(tmp_path):
    """The plan's KV cache is the bytes of the tensors the engine allocates for the plan's context and batch:
    the full-attention layers' keys and values, and ``batch`` x the linear layers' conv and recurrent states."""
    from tiny_hybrid import QWEN3_NEXT, make_checkpoint

    from moeflow import MoEModel, OffloadConfig
    from moeflow.engine.kv_slots import SlotKVCache

    path, _ = make_checkpoint(tmp_path, "qwen3_next", **QWEN3_NEXT["interval2-gqa-dense-first"])
    for batch in (1, 3):
        model = MoEModel.from_pretrained(path, offload=OffloadConfig(
            policy="lru", gpu_expert_slots=4, context_length=32, max_batch_size=batch))
        try:
            plan = model.memory_plan()
            assert (plan.batch, plan.context_length) == (batch, 32)
            cache = model.runner.new_cache(batch, 32, reuse=False)  # generate's
            state = _tensor_bytes(cache.linear.conv, cache.linear.recurrent)
            assert state > 0 and cache.linear.recurrent.shape[1] == batch
            assert plan.kv_cache == _tensor_bytes(cache.k, cache.v) + state
            rows = SlotKVCache.for_model(model, 32, max_rows=batch)  # the server's
            assert plan.kv_cache == _tensor_bytes(rows.k, rows.v, rows.linear.conv, rows.linear.recurrent)
        finally:
            model.close()
