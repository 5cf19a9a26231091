"""CUDA-graph capture of the decode step, piecewise around the expert backend (issue 14 item 6).

On the CPU the pieces are captured by :class:`TraceCapture`, which gives them CUDA-graph semantics: a piece is
the list of aten ops run while it was captured, replayed on the same tensors (inputs copied into static
buffers, outputs written into the tensors the capture produced; a Triton launch, interpreted, is one op launched
again). Whatever a piece decided in Python from
values at capture time is frozen, exactly as in a CUDA graph, so replays that give the eager tokens step after
step show the pieces are value-independent; a host read (``.item()``, ``bool``, ``.tolist()`` via the
:class:`DeviceTensor` of test_host_loop), a data-dependent shape (``nonzero``, ``unique``, ``bincount``) or
host data copied in (``torch.tensor(...)``) while capturing is refused as the device would refuse it. The
real capture on a GPU is the CUDA test at the end (run by ``benchmarks/run_all_gpu.sh correctness``).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import pytest
import torch
from graph_capture import TraceCapture
from test_host_loop import DeviceTensor

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
PROMPT = "The \"with\" statement is used to wrap the execution"


class HostArgs:
    """The expert backend called with plain tensors (the pieces' outputs are DeviceTensors; the backend's own
    read-back is test_host_loop's subject). Everything else is the wrapped backend's."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, layer, *tensors):
        return self.backend.forward(layer, *(t.as_subclass(torch.Tensor) for t in tensors))

    def forward_logits(self, layer, x, router_logits, route, kernel_routing, want_ids):
        return self.backend.forward_logits(layer, x.as_subclass(torch.Tensor), router_logits.as_subclass(torch.Tensor),
                                           route, kernel_routing, want_ids)


def on_device(decoder):
    """The decode function with its step inputs as DeviceTensors: anything computed from them that reads
    values back to the host raises."""
    def decode(embeds, positions, cache, cache_position, token_mask, experts, routing=None):
        return decoder(*(t.as_subclass(DeviceTensor) for t in (embeds, positions)), cache,
                       *(t.as_subclass(DeviceTensor) for t in (cache_position, token_mask)), experts, routing)
    return decode


def captured_model(offload: OffloadConfig | None, inner=None):
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=offload)
    graphs = model.capture_decode(capture_factory=TraceCapture)
    graphs.inner = inner(model.model) if inner is not None else on_device(model.model)
    # every backend through a boundary here: the resident one's torch reference kernels check values on the host
    # (the Triton path skips its checks while a CUDA graph captures; the GPU test below captures it whole)
    model.use_backend(HostArgs(model.experts))
    return model, graphs


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=24)], ids=["resident", "lru"])
def test_replayed_pieces_give_the_eager_tokens(offload):
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)] * 2)
    want = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    model, graphs = captured_model(offload)
    try:
        got = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
        again = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])  # same cache: no capture
    finally:
        model.close()
    assert graphs.refused is None
    assert torch.equal(got, want) and torch.equal(again, want)
    assert graphs.captures == 1
    layers = model.config.num_hidden_layers  # one piece before each backend call, one after the last
    assert len(graphs.step.replays) == layers + 1
    assert [c.layer for c in graphs.step.calls] == list(range(layers))
    assert all(graphs._capture.pieces)  # every piece holds device work


def test_a_piece_that_reads_back_is_refused_and_the_step_runs_eagerly(caplog):
    def syncing(decoder):
        def decode(embeds, *args):
            if float(embeds.as_subclass(torch.Tensor).abs().sum()) < 0:  # a host read in the hot region
                raise AssertionError("unreachable")
            return decoder(embeds, *args)
        return decode  # (plain tensors: the eager fallback runs it too)

    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)])
    want = ref.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
    model, graphs = captured_model(OffloadConfig(policy="lru", gpu_expert_slots=24), inner=syncing)
    try:
        with caplog.at_level(logging.WARNING, logger="moeflow.engine.cuda_graphs"):
            got = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert graphs.refused and "aten.item" in graphs.refused
    assert "capture of the decode step refused" in caplog.text
    assert torch.equal(got, want) and graphs.step is None


def test_passes_over_some_rows_of_a_cache_run_eagerly():
    """Micro-batches and the serving engine pass a new view of some cache rows every time: never captured."""
    model, graphs = captured_model(None)
    runner = model.runner
    try:
        cache = runner.new_cache(2, 8)
        rows = torch.tensor([1])
        embeds = runner.decoder.embed_tokens(torch.tensor([[3]]))
        logits = graphs(embeds, torch.tensor([[0]]), cache.rows(rows), torch.tensor([0]),
                        torch.ones(1, 1, dtype=torch.bool), model.experts)
    finally:
        model.close()
    assert logits.shape == (1, 1, model.config.vocab_size)
    assert graphs.captures == 0 and graphs.step is None


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", cuda_graphs=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")
@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_cuda_graph_decode_gives_the_eager_tokens_on_a_gpu(policy):
    load = dict(device="cuda", dtype=torch.float16, kernels="auto")
    offload = OffloadConfig(policy=policy, gpu_expert_slots=None if policy == "resident" else 24)
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, **load, offload=offload, cuda_graphs=False)
    ref.runner.reuse_cache = True  # the graph run's bucketed cache length: only replay vs eager differs
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)] * 2, device="cuda")
    want = ref.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
    ref.close()
    model = MoEOffloadedMixtral.from_pretrained(MODEL, **load, offload=offload, cuda_graphs=True)
    try:
        got = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
        again = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
        graphs = model.runner.decode_fn
    finally:
        model.close()
    assert graphs.refused is None, graphs.refused
    assert graphs.captures == 1
    assert torch.equal(got, want) and torch.equal(again, want)


class PoolRuleCapture(TraceCapture):
    """TraceCapture under torch's pool rule: each capture object is one memory pool, and a capture into a pool
    whose graphs have all been freed fails as CUDACachingAllocator's ``use_count > 0`` assert does (torch 2.11)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device)
        self.live_graphs = 0
        self.ever_used = False

    def begin(self) -> None:
        if self.ever_used and self.live_graphs == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a dead pool captured into)")
        super().begin()

    def end(self):
        replay = super().end()
        self.live_graphs += 1
        self.ever_used = True
        graph = _Graph(replay)
        weakref.finalize(graph, self._freed)
        return graph

    def _freed(self) -> None:
        self.live_graphs -= 1


class _Graph:
    """A replay callable whose lifetime stands for a CUDAGraph's."""

    def __init__(self, replay) -> None:
        self.replay = replay

    def __call__(self) -> None:
        self.replay()


def _eager(offload: OffloadConfig | None, calls: list[tuple[torch.Tensor, torch.Tensor | None, int]]):
    """The eager tokens of each (ids, attention_mask, max_new_tokens) call (a cache of exactly its length)."""
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=offload)
    try:
        return [ref.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=[])
                for ids, mask, n in calls]
    finally:
        ref.close()


def test_lengths_in_one_bucket_replay_one_capture_and_another_bucket_recaptures_into_a_fresh_pool():
    """The kept cache is 256 positions for every call up to 256 tokens: other prompt lengths and max_new_tokens
    replay the same graphs (a forward() pass between them leaves the cache alone). Another batch size, or a call
    past 256 (bucket 512, the tiny model's max_position_embeddings), captures again, into a fresh pool (torch's
    allocator refuses a dead one: PoolRuleCapture), and so does the next short call (one cache is kept). Every
    call gives the eager tokens."""
    tok = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch").tokenizer
    words = tok.encode(PROMPT)
    long = torch.tensor([(words * 40)[:250]])
    calls = [(torch.tensor([words]), None, 6), (torch.tensor([words]), None, 9), (torch.tensor([words[:5]]), None, 12),
             (torch.tensor([words] * 2), None, 6), (long, None, 10), (torch.tensor([words]), None, 6)]
    want = _eager(None, calls)
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    graphs = model.capture_decode(capture_factory=PoolRuleCapture)
    graphs.inner = on_device(model.model)
    model.use_backend(HostArgs(model.experts))
    captures, lengths = [], []
    try:
        for i, (ids, mask, n) in enumerate(calls):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=[])
            assert torch.equal(got, want[i]), f"call {i} ({tuple(ids.shape)} + {n} tokens)"
            captures.append(graphs.captures)
            lengths.append(graphs.step.cache.max_len)
            if i == 1:
                model(torch.tensor([words] * 3))  # a prefill-only pass: a cache of its own
    finally:
        model.close()
    assert graphs.refused is None
    assert captures == [1, 1, 1, 2, 3, 4]
    assert lengths == [256, 256, 256, 256, 512, 256]


def test_cache_length_rounds_up_to_the_bucket_within_the_model_limit():
    from moeflow.engine.generate import cache_length

    assert [cache_length(n, 512) for n in (1, 28, 256, 257, 512)] == [256, 256, 256, 512, 512]
    assert cache_length(290, 300) == 300  # the model's max_position_embeddings caps it
    assert cache_length(700, 512) == 700  # never fewer positions than asked (generate refuses those first)


def test_cuda_graphs_default_to_the_device():
    from moeflow.engine.cuda_graphs import graphs_wanted

    assert graphs_wanted(None, torch.device("cuda")) and graphs_wanted(True, torch.device("cuda", 1))
    assert not graphs_wanted(None, torch.device("cpu")) and not graphs_wanted(False, torch.device("cuda"))
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        graphs_wanted(True, torch.device("cpu"))
    for cuda_graphs in (None, False):  # the default on the CPU: eager, a cache of exactly each call's length
        model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", cuda_graphs=cuda_graphs)
        assert model.runner.decode_fn is model.model and not model.runner.reuse_cache
        assert model.runner.new_cache(1, 20).max_len == 20
        model.close()


@pytest.mark.parametrize("offload", [OffloadConfig(policy="lru", gpu_expert_slots=8),
                                     OffloadConfig(policy="mixtral-offloading", gpu_expert_slots=12)],
                         ids=["lru", "mixtral-offloading"])
def test_offloaded_decode_on_the_bucketed_cache_gives_the_eager_resident_tokens(offload):
    """The exact-token invariant with the kept cache: an offload policy's captured decode, a left-padded batch,
    a long call then shorter ones in the same bucket (their masked positions hold the long call's keys) equal
    the eager resident model's tokens."""
    tok = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch").tokenizer
    words = tok.encode(PROMPT)
    ids = torch.tensor([words, [0, 0, 0] + words[3:]])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = [(ids, mask, 30), (ids[:, 2:], mask[:, 2:], 7), (ids, mask, 12)]
    want = _eager(None, calls)
    model, graphs = captured_model(offload)
    try:
        got = [model.generate(i, attention_mask=m, max_new_tokens=n, do_sample=False, eos_token_id=[])
               for i, m, n in calls]
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures == 1 and graphs.step.cache.max_len == 256
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"call {i}"


def test_the_serving_engine_without_cuda_graphs_runs_a_captured_model_eagerly():
    """With cuda_graphs=False the engine's passes read rows of its slotted cache through a new view each: the
    captured step runs them eagerly, with the tokens of the uncaptured model, and captures nothing (the engine's
    captured passes: tests/test_serve_graphs.py)."""
    from moeflow.engine.continuous import ContinuousEngine, SamplingParams
    from moeflow.engine.kv_slots import SlotKVCache

    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    prompts = [model.tokenizer.encode(PROMPT)[:n] for n in (4, 11)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
            for p in prompts]
    graphs = model.capture_decode(capture_factory=TraceCapture)
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=2), cuda_graphs=False).start()
    try:
        got = [s.result(120) for s in [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]]
    finally:
        engine.stop()
        model.close()
    assert got == want
    assert graphs.captures == 0 and graphs.step is None and graphs.refused is None
