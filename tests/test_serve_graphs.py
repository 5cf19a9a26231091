"""The serving engine's decode passes as CUDA graphs (moeflow.engine.continuous, ``cuda_graphs``).

On the CPU the captured steps run through test_compile_cuda_graphs' :class:`TraceCapture` (a host read or a
data-dependent shape while capturing is refused; replays re-run the recorded ops on the recorded tensors, as a
graph does), so equal tokens show the padded passes over :class:`SlotDecodeView` are value-independent. Requests
arrive and finish at different times (batch sizes 1, 3, 5 padded to 1, 4, 8, and the sizes they leave behind)
and one sequence crosses the 256-key bucket: the captured engine gives the eager engine's tokens and each
request's own greedy ``generate`` tokens, resident and offloaded. The real capture is the CUDA test at the end.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from test_compile_cuda_graphs import MODEL, HostArgs, PoolRuleCapture, TraceCapture, on_device

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.continuous import ContinuousEngine, SamplingParams, key_bucket, padded_batch
from moeflow.engine.kv_slots import SlotKVCache

TIMEOUT_S = 120
TEXT = b"The import statement combines two operations; it searches for the named module, then it binds the result "
LONG = list((TEXT * 3)[:248])  # decodes past position 255: its key bucket grows from 256 to 512
# (prompt, max_new_tokens, arrivals): when this request has produced arrivals[0] tokens, the next arrivals[1] come
PLAN = [(list(TEXT[:9]), 14, (2, 2)), (list(TEXT[:23]), 9, None), (LONG, 16, (3, 2)), (list(TEXT[:5]), 6, None),
        (list(TEXT[:31]), 4, None)]
LRU = OffloadConfig(policy="lru", gpu_expert_slots=8)


def run_engine(model, cuda_graphs: bool | None, warm_up: bool = False
               ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """PLAN's requests through a fresh engine (``warm_up``: ContinuousEngine.warm_up first, its views not logged):
    the first alone, the others arriving as earlier ones produce tokens (the decode batch grows 1 -> 3 -> 5, then
    shrinks as they finish). Returns each request's tokens and the (batch, key_len) of every captured decode pass."""
    cache = SlotKVCache.for_model(model, 512, max_rows=6)
    views, make_view = [], cache.decode_view

    def logged_view(batch: int, key_len: int):
        views.append((batch, key_len))
        return make_view(batch, key_len)

    cache.decode_view = logged_view
    engine = ContinuousEngine(model, cache, prefill_chunk=64, cuda_graphs=cuda_graphs)
    if warm_up:
        engine.warm_up()
        views.clear()
    seqs: list = [None] * len(PLAN)
    upcoming = list(range(1, len(PLAN)))
    finished = threading.Semaphore(0)

    def submit(i: int) -> None:  # on the test thread first, then on the engine thread (inside on_event)
        prompt, n, arrivals = PLAN[i]

        def on_event(token, reason):
            if token is not None and arrivals is not None and len(seqs[i].generated) == arrivals[0]:
                for _ in range(arrivals[1]):
                    submit(upcoming.pop(0))
            if reason is not None:
                finished.release(len(PLAN) if reason == "error" else 1)  # an error: stop waiting at once
        seqs[i] = engine.submit(prompt, SamplingParams(max_new_tokens=n), on_event=on_event)

    model.stats.reset()
    submit(0)
    engine.start()
    try:
        for _ in PLAN:
            assert finished.acquire(timeout=TIMEOUT_S), "the engine did not finish every request in time"
    finally:
        engine.stop()
    assert [s.finish_reason for s in seqs] == ["length"] * len(PLAN), [s.error for s in seqs]
    return [s.generated for s in seqs], views


def plain_logits(decode):
    """The decode function's logits as a plain tensor: the engine reads them back after the pass (the step's
    inputs, and all it computes from them before its end, stay DeviceTensors)."""
    return lambda *args: decode(*args).as_subclass(torch.Tensor)


def captured(offload: OffloadConfig | None, inner=None, capture=TraceCapture):
    """The tiny model decoding through TraceCapture'd steps (its step inputs DeviceTensors: no host read)."""
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=offload)
    graphs = model.capture_decode(capture_factory=capture)
    graphs.inner = inner(model.model) if inner is not None else plain_logits(on_device(model.model))
    model.use_backend(HostArgs(model.experts))
    return model, graphs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Each request alone through in-process greedy generate, all experts resident, eager."""
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    try:
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])[0, len(p):]
                .tolist() for p, n, _ in PLAN]
    finally:
        model.close()


def test_padding_and_key_buckets():
    assert [padded_batch(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert [key_bucket(n, 4096) for n in (1, 256, 257, 600, 4096)] == [256, 256, 512, 1024, 4096]
    assert key_bucket(257, 300) == 300 and key_bucket(10, 128) == 128  # never past the row


@pytest.mark.parametrize("offload", [None, LRU], ids=["resident", "lru"])
def test_captured_decode_passes_give_the_eager_engines_and_generates_tokens(offload, reference):
    eager_model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=offload)
    try:
        eager, eager_views = run_engine(eager_model, cuda_graphs=None)  # a CPU model: no graphs, no views
        eager_decode_tokens = eager_model.stats.decode.tokens
    finally:
        eager_model.close()
    model, graphs = captured(offload)
    try:
        got, views = run_engine(model, cuda_graphs=None)  # on: the model decodes through CudaGraphDecode
        decode_tokens = model.stats.decode.tokens
        device_graphs = model.experts.device_graphs if offload is not None else None
    finally:
        model.close()
    assert graphs.refused is None
    assert got == eager == reference
    assert eager_views == []
    sizes = {b for b, _ in views}
    assert {1, 4, 8} <= sizes and {256, 512} == {k for _, k in views}
    assert graphs.captures == len(set(views)) < len(views)  # a repeated shape replays its step
    assert len(graphs.steps) == len(set(views))  # every (batch, key bucket) kept (fewer than max_steps)
    # only real tokens are counted: every token but each request's first (its prefill's)
    assert decode_tokens == eager_decode_tokens == sum(n - 1 for _, n, _ in PLAN)
    if device_graphs is not None:  # the offload backend's device part, captured once per padded batch size
        assert device_graphs.refused == {} and set(device_graphs.buckets) == sizes
        assert device_graphs.captures == len(sizes) and device_graphs.replays > 0


def test_a_refused_capture_serves_eagerly_with_the_same_tokens(caplog, reference):
    def syncing(decoder):
        def decode(embeds, *args):
            if float(embeds.as_subclass(torch.Tensor).abs().sum()) < 0:  # a host read in the captured region
                raise AssertionError("unreachable")
            return decoder(embeds, *args)
        return decode

    model, graphs = captured(LRU, inner=syncing)
    try:
        with caplog.at_level(logging.WARNING, logger="moeflow.engine.cuda_graphs"):
            got, views = run_engine(model, cuda_graphs=True)
    finally:
        model.close()
    assert graphs.refused and "aten.item" in graphs.refused
    assert caplog.text.count("capture of the decode step refused") == 1
    assert got == reference
    assert len(views) == 1 and graphs.steps == {} and graphs.captures == 0  # after the refusal: eager passes


def test_a_generate_call_between_passes_drops_the_engines_steps_and_the_engine_recaptures(reference):
    """The engine's steps and generate's belong to different caches: capturing one owner's drops the other's."""
    model, graphs = captured(None)
    try:
        got, _ = run_engine(model, cuda_graphs=None)
        engine_steps = graphs.captures
        p, n, _ = PLAN[0]
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])
        assert len(graphs.steps) == 1 and graphs.step.cache is model.runner._last_cache[1]
        again, _ = run_engine(model, cuda_graphs=None)
    finally:
        model.close()
    assert got == again == reference and out[0, len(p):].tolist() == reference[0]
    assert graphs.captures == 2 * engine_steps + 1


def test_beyond_max_steps_the_least_recent_step_is_dropped_and_captured_again(reference):
    """Two steps kept: the engine's shapes (more than two) evict each other; a shape met again after its eviction
    captures again, into a fresh pool (PoolRuleCapture: torch refuses a pool whose graphs are all gone)."""
    model, graphs = captured(LRU, capture=PoolRuleCapture)
    graphs.max_steps = 2
    try:
        got, views = run_engine(model, cuda_graphs=None)
    finally:
        model.close()
    assert graphs.refused is None and got == reference
    assert len(graphs.steps) == 2 and graphs.captures > len(set(views))
    changes = sum(a != b for a, b in zip(views, views[1:], strict=False))  # a capture at most at each change
    assert graphs.captures <= changes + 1


@pytest.mark.parametrize("offload", [LRU, OffloadConfig(policy="expertflow", gpu_expert_slots=8)],
                         ids=["lru", "expertflow"])
def test_warm_up_captures_every_padded_batch_size_and_a_burst_captures_nothing_more(offload, reference):
    """warm_up() before start: one step per padded batch size up to the rows (1, 2, 4, 8 for 6 rows) at the
    256-key bucket, the offload backend's device part per size too; the cache is left as it was. A burst of
    requests (decode batches of 1 to 4, all below 256 keys) then replays only, with each request's own tokens."""
    model, graphs = captured(offload)
    try:
        cache = SlotKVCache.for_model(model, 512, max_rows=6)
        engine = ContinuousEngine(model, cache, prefill_chunk=16)
        assert (engine.history is not None) == (offload.policy == "expertflow")  # only a path predictor reads it
        steps, seconds = engine.warm_up()
        assert steps == graphs.captures == 4 and seconds >= 0 and graphs.refused is None
        assert sorted(k[1][0] for k in graphs.steps) == [1, 2, 4, 8]  # the steps' embeds [Bp, 1, H]
        assert {s.cache.key_len for s in graphs.steps.values()} == {256}
        assert cache.free_rows == 6 and not cache.valid.any()
        device_graphs = model.experts.device_graphs
        device_captures = device_graphs.captures
        assert set(device_graphs.buckets) == {1, 2, 4, 8} and device_graphs.refused == {}
        burst = [0, 1, 3, 4]  # PLAN's short requests, all at once
        engine.start()
        try:
            seqs = [engine.submit(PLAN[i][0], SamplingParams(max_new_tokens=PLAN[i][1])) for i in burst]
            got = [s.result(TIMEOUT_S) for s in seqs]
        finally:
            engine.stop()
        assert graphs.captures == steps and device_graphs.captures == device_captures  # nothing captured again
    finally:
        model.close()
    assert got == [reference[i] for i in burst]


def test_warm_up_is_off_without_graphs():
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    try:
        cache = SlotKVCache.for_model(model, 64, max_rows=2)
        assert ContinuousEngine(model, cache).warm_up() == (0, 0.0) and cache.free_rows == 2
    finally:
        model.close()


def test_cuda_graphs_true_needs_a_captured_model():
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    try:
        with pytest.raises(ValueError, match="cuda_graphs=True needs a model that decodes through CUDA graphs"):
            ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=1), cuda_graphs=True)
        model.capture_decode(capture_factory=TraceCapture)
        off = ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=1), cuda_graphs=False)
        assert off.graphs is None
    finally:
        model.close()


def eager_and_captured_on_a_gpu(offload: OffloadConfig, warm_up: bool = False):
    """PLAN through the engine of an eager model, then of one with CUDA graphs (fp16, compiled kernels):
    (eager tokens, captured tokens, the captured run's decode views, its CudaGraphDecode)."""
    load = dict(device="cuda", dtype=torch.float16, kernels="auto", offload=offload)
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, **load, cuda_graphs=False)
    try:
        want, _ = run_engine(ref, cuda_graphs=None)
    finally:
        ref.close()
    model = MoEOffloadedMixtral.from_pretrained(MODEL, **load, cuda_graphs=True)
    try:
        got, views = run_engine(model, cuda_graphs=None, warm_up=warm_up)
        return want, got, views, model.runner.decode_fn
    finally:
        model.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")
@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_captured_engine_gives_the_eager_engines_tokens_on_a_gpu(policy):
    want, got, views, graphs = eager_and_captured_on_a_gpu(
        OffloadConfig(policy=policy, gpu_expert_slots=None if policy == "resident" else 8))
    assert graphs.refused is None, graphs.refused
    assert got == want
    assert {1, 4, 8} <= {b for b, _ in views} and graphs.captures == len(set(views)) < len(views)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")
def test_warmed_up_engine_captures_only_beyond_the_first_key_bucket_on_a_gpu():
    """After warm_up (batch sizes 1, 2, 4, 8 at 256 keys) only the 512-key passes of PLAN's long request capture."""
    want, got, views, graphs = eager_and_captured_on_a_gpu(LRU, warm_up=True)
    assert graphs.refused is None, graphs.refused
    assert got == want
    assert graphs.captures == 4 + len({v for v in views if v[1] > 256})
