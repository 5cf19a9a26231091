"""The continuous-batching engine and its row-slotted KV cache, in process (no server)."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ContinuousEngine, EngineOverloaded, SamplingParams
from moeflow.engine.kv_slots import SlotKVCache, kv_bytes_per_row
from moeflow.errors import InputError

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model():
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path())


def prompts() -> list[list[int]]:
    text = b"The import statement combines two operations; it searches for the named module, then it binds "
    return [list(text[:n]) for n in (3, 17, 40, 95)]


@pytest.fixture(scope="module")
def offloaded():
    """Half of the 32 experts in slots, LRU: the scheduler's backend sees the engine's mixed batches."""
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                               offload=OffloadConfig(gpu_expert_slots=16, policy="lru"))


@pytest.mark.parametrize("which", ["resident", "lru"])
def test_chunked_prefill_and_joining_mid_decode_give_single_request_tokens(which, request):
    """A prefill chunk of 7 splits every prompt but the shortest; rows join while others decode."""
    model = request.getfixturevalue("model" if which == "resident" else "offloaded")
    budgets = (12, 5, 20, 9)
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
            for p, n in zip(prompts(), budgets, strict=True)]
    cache = SlotKVCache(model.config.num_hidden_layers, 3, 128, model.config.num_key_value_heads,
                        model.config.head_dim, model.dtype, model.device)  # 3 rows for 4 requests: one waits
    engine = ContinuousEngine(model, cache, prefill_chunk=7).start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts(), budgets, strict=True)]
        got = [s.result(TIMEOUT_S) for s in seqs]
    finally:
        engine.stop()
    assert got == want
    assert cache.free_rows == 3


def test_seeded_sampling_matches_generate(model):
    p = prompts()[1]
    want = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20,
                          seed=5, eos_token_id=[])[0, len(p):].tolist()
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=2)).start()
    try:
        params = SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20, seed=5)
        assert engine.submit(p, params).result(TIMEOUT_S) == want
    finally:
        engine.stop()


def test_stop_tokens_zero_tokens_and_cancelled_requests(model):
    p = prompts()[2]
    free = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 128, max_rows=1), max_queue=2)
    waiting = engine.submit(p, SamplingParams(max_new_tokens=8))
    waiting.cancel()  # cancelled before the engine ever ran it
    stopped = engine.submit(p, SamplingParams(max_new_tokens=8, stop_token_ids=(free[3],)))
    with pytest.raises(EngineOverloaded):
        engine.submit(p, SamplingParams(max_new_tokens=8))  # two already wait: the queue is full
    engine.start()
    try:
        assert stopped.result(TIMEOUT_S) == free[: free.index(free[3]) + 1] and stopped.finish_reason == "stop"
        assert waiting.result(TIMEOUT_S) == [] and waiting.finish_reason == "cancelled"
        empty = engine.submit(p, SamplingParams(max_new_tokens=0))
        assert empty.result(TIMEOUT_S) == [] and empty.finish_reason == "length"
    finally:
        engine.stop()


def test_requests_that_can_never_fit_are_refused(model):
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=1))
    with pytest.raises(InputError, match="exceeds the context of 64"):
        engine.submit(list(range(60)), SamplingParams(max_new_tokens=5))
    with pytest.raises(InputError, match="empty"):
        engine.submit([], SamplingParams(max_new_tokens=5))
    with pytest.raises(InputError, match="vocabulary"):
        engine.submit([1, 300], SamplingParams(max_new_tokens=5))


def test_kv_rows_come_from_the_budget(model):
    cfg = model.config
    row = kv_bytes_per_row(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 256, model.dtype)
    assert SlotKVCache.for_model(model, 256, budget_bytes=5 * row + row // 2, max_rows=16).rows == 5
    assert SlotKVCache.for_model(model, 256, budget_bytes=100 * row, max_rows=16).rows == 16
    with pytest.raises(InputError, match="holds no sequence"):
        SlotKVCache.for_model(model, 256, budget_bytes=row - 1)
    with pytest.raises(InputError, match="max_position_embeddings"):
        SlotKVCache.for_model(model, cfg.max_position_embeddings + 1)
    cache = SlotKVCache.for_model(model, 256, max_rows=2)
    rows = [cache.allocate(), cache.allocate()]
    assert rows == [0, 1] and cache.allocate() is None
    cache.release(0)
    with pytest.raises(ValueError):
        cache.release(0)


def test_expertflow_plans_from_each_rows_history():
    """PLEC plans every pass from StepInfo (token history per row): mixed prefill/decode batches stay exact."""
    m = MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                            offload=OffloadConfig(gpu_expert_slots=16, policy="expertflow"))
    budgets = (6, 4, 8)
    want = [m.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
            for p, n in zip(prompts()[:3], budgets, strict=True)]
    engine = ContinuousEngine(m, SlotKVCache.for_model(m, 128, max_rows=2), prefill_chunk=9).start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts()[:3], budgets, strict=True)]
        assert [s.result(TIMEOUT_S) for s in seqs] == want
    finally:
        engine.stop()


def test_right_padding_of_short_chunks_reaches_no_expert(offloaded):
    """A prefill pass right-pads the shorter chunks to the longest; only the prompts' own tokens are routed
    (each once), so the padding pulls no expert into the slots."""
    backend = offloaded.experts
    inner, routed = backend._route_and_forward, {"prefill": 0, "decode": 0}

    def counting(layer, x, *args):
        if layer == 0:
            routed[offloaded.stats.phase] += x.shape[0]
        return inner(layer, x, *args)

    backend._route_and_forward = counting
    engine = ContinuousEngine(offloaded, SlotKVCache.for_model(offloaded, 128, max_rows=4), prefill_chunk=20).start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=2)) for p in prompts()]
        for s in seqs:
            s.result(TIMEOUT_S)
    finally:
        engine.stop()
        del backend._route_and_forward
    assert routed["prefill"] == sum(len(p) for p in prompts())  # 155 real tokens in chunks padded to up to 20
    assert routed["decode"] == len(prompts())  # one decode pass per request (its second token)
