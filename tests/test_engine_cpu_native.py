"""The serving engine on the CPU takes generate()'s one-call native decode step (engine/cpu_layers.py) when one
sequence decodes alone: its row of the slotted cache as a batch-1 static cache (SlotKVCache.row), with the same
greedy tokens as generate() at 1 and 2 threads; a decode pass of up to ROW_LOOP_MAX rows runs them one after another
the same way, and a larger one runs the layers one by one over the batch. And the native attention over a long
cache holding a short sequence scans only the sequence's own positions (step.c's mf_mask_extent): the same numbers
as over a cache of its length."""

from __future__ import annotations

import pytest
import torch
from helpers import count_calls

import moeflow.engine.cpu_layers as cpu_layers
from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ROW_LOOP_MAX, ContinuousEngine, SamplingParams
from moeflow.engine.kv_cache import StaticKVCache
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.step import attention_step

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")
TIMEOUT_S = 120
PROMPTS = [list(b"The import statement combines"), list(b"It searches for the named module, then binds")]


@pytest.fixture(scope="module")
def model():
    """The embedded model with 4-bit attention on the CPU: its decoder has the one-call step (layers_step)."""
    m = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=4)
    assert m.device.type == "cpu" and m.model.layers_step is not None
    return m


@pytest.fixture
def counted(monkeypatch):
    """How many passes took the one native call."""
    return count_calls(monkeypatch, cpu_layers, "layers_step")


def _generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              eos_token_id=[])[0, len(prompt):].tolist()


@pytest.mark.parametrize("threads", [1, 2])
def test_one_sequence_takes_the_native_step_with_generates_tokens(model, counted, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 10
        want = [_generate(model, p, n) for p in PROMPTS]
        # rows of 512 positions (serve's are 4096): the native attention reads the row in place, a short sequence
        cache = SlotKVCache.for_model(model, 512, max_rows=2)
        engine = ContinuousEngine(model, cache).start()
        try:
            got, steps = [], []
            for p in PROMPTS + PROMPTS[:1]:  # the third: the first prompt again, its keys from the prefix cache
                counted[0] = 0
                got.append(engine.submit(p, SamplingParams(max_new_tokens=n)).result(TIMEOUT_S))
                steps.append(counted[0])
        finally:
            engine.stop()
        assert got == want + want[:1]
        # every decode pass (the first token comes from the prompt's prefill in torch: more than 16 tokens); the
        # prefix cache's request prefills its last prompt token alone: one more
        assert steps == [n - 1, n - 1, n]
        assert isinstance(cache.row(0), StaticKVCache) and cache.row(0) is cache.row(0)  # one view per row
    finally:
        torch.set_num_threads(before)


def test_a_few_rows_step_one_after_another_and_more_run_the_layers_together(model, counted):
    """ROW_LOOP_MAX rows decoding at their own positions: one native call per row and pass; one more row: the
    layers one by one over the batch (no native call). Generate's tokens either way."""
    n = 6
    prompts = [*PROMPTS, list(b"Then"), list(b"So the module")][: ROW_LOOP_MAX + 1]
    want = [_generate(model, p, n) for p in prompts]
    for k, native in ((ROW_LOOP_MAX, ROW_LOOP_MAX * (n - 1)), (ROW_LOOP_MAX + 1, 0)):
        engine = ContinuousEngine(model, SlotKVCache.for_model(model, 128, max_rows=k), prefill_chunk=256)
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p in prompts[:k]]  # (all admitted at once)
        counted[0] = 0
        engine.start()
        try:
            got = [s.result(TIMEOUT_S) for s in seqs]
        finally:
            engine.stop()
        assert got == want[:k]
        assert counted[0] == native  # (the one prefill pass holds every row: no native call)


def test_native_attention_over_a_long_cache_is_the_short_caches_numbers():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, pos = 4, 2, 16, 21
    qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(1, 1, d, generator=g), torch.randn(1, 1, d, generator=g)
    short_k, short_v = (torch.randn(1, kv_heads, pos + 1, d, generator=g) for _ in range(2))
    outs = []
    for length in (pos + 1, 300):  # (300: the scan stops at position pos, past 37 words of masked positions)
        k, v = torch.zeros(1, kv_heads, length, d), torch.zeros(1, kv_heads, length, d)
        k[:, :, : pos + 1], v[:, :, : pos + 1] = short_k, short_v
        mask = torch.zeros(1, 1, 1, length, dtype=torch.bool)
        mask[..., : pos + 1] = True
        mask[..., 3] = False  # (a hole inside: still skipped)
        outs.append(attention_step(qkv, heads, kv_heads, cos, sin, k, v, torch.tensor([pos]), mask))
    assert torch.equal(outs[0], outs[1])
