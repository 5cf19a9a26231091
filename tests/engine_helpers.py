"""The continuous-batching engine driven as the server drives it, for tests that compare its tokens with
per-request ``generate``: every prompt submitted at once (the ones that find no free row wait), and a model whose
decode steps are captured with the CPU stand-in of CUDA graphs (test_compile_cuda_graphs' TraceCapture)."""

from __future__ import annotations

import torch
from test_compile_cuda_graphs import HostArgs, TraceCapture, on_device

from moeflow import MoEModel
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.kv_slots import SlotKVCache

TIMEOUT_S = 120
BUDGETS = (9, 4, 12, 6, 7)  # new tokens of each of prompts()'s requests


def prompts() -> list[list[int]]:
    """Five prompts of 3 to 17 tokens (the longer ones span several prefill chunks of 5)."""
    gen = torch.Generator().manual_seed(8)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 11, 17, 6, 9)]


def serve_all(model, prompts: list[list[int]], budgets: tuple[int, ...], rows: int = 3, chunk: int = 5,
              cache_type: type = SlotKVCache) -> list[list[int]]:
    """Greedy replies of ``prompts`` (``budgets`` new tokens each) from an engine of ``rows`` rows of 64 positions
    and prefill chunks of ``chunk`` tokens; the cache (``SlotKVCache.for_model``) must be a ``cache_type``."""
    cache = SlotKVCache.for_model(model, 64, max_rows=rows)
    assert isinstance(cache, cache_type), type(cache)
    engine = ContinuousEngine(model, cache, prefill_chunk=chunk).start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets, strict=True)]
        got = [s.result(TIMEOUT_S) for s in seqs]
    finally:
        engine.stop()
    assert cache.free_rows == rows
    return got


def generate_each(model, prompts: list[list[int]], budgets: tuple[int, ...]) -> list[list[int]]:
    """Each prompt's greedy reply from ``generate`` alone."""
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])[0, len(p):]
            .tolist() for p, n in zip(prompts, budgets, strict=True)]


def captured_model(path):
    """(the model at ``path`` with its decode steps captured by TraceCapture, its CudaGraphDecode)."""
    model = MoEModel.from_pretrained(path, kernels="torch")
    graphs = model.capture_decode(capture_factory=TraceCapture)
    inner = on_device(model.model)
    graphs.inner = lambda *args: inner(*args).as_subclass(torch.Tensor)
    model.use_backend(HostArgs(model.experts))
    return model, graphs


def assert_captured_serving_is_eager(path, serve) -> None:
    """``serve(model)`` on the checkpoint at ``path`` gives the same tokens with the decode steps captured (and
    something really captured) as eagerly."""
    eager = MoEModel.from_pretrained(path, kernels="torch")
    want = serve(eager)
    eager.close()
    model, graphs = captured_model(path)
    try:
        got = serve(model)
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures > 0
    assert got == want
