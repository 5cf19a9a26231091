"""Prompt lookup decoding through the captured decode step (moeflow.engine.lookup with ``cuda_graphs`` / ``compile``).

A drafted pass is one static shape, 1 + prompt_lookup_num_tokens tokens (a shorter draft followed by fillers whose
logits are never read), so the runner replays a second captured step instead of running it eagerly. On the CPU the
capture is the recording stand-in of tests/test_compile_cuda_graphs.py (:class:`TraceCapture`: a piece is the list
of aten ops it ran, replayed on the same tensors, with CUDA-graph semantics). Here: once warmed every pass replays
(no eager call), two steps are captured per cache, the tokens are plain greedy decoding's, resident and offloaded
(the offload backend's device part captured too), fillers reach no expert unless the backend is traced whole, and
under torch.compile the drafted width compiles a bounded number of graphs once. The same on a GPU: the CUDA test.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from test_compile_cuda_graphs import HostArgs, TraceCapture, on_device
from torch._dynamo.utils import counters

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine import lookup
from moeflow.engine.lookup import pass_inputs

NEW_TOKENS = 40
# the second prompt's reply has drafts shorter than DRAFT, all kept, before its end: a pass after a padded one
# then reads the keys written beside the fillers
PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", "1 2 3 4 5 6 7 8 9")
DRAFT = 4  # prompt_lookup_num_tokens: drafted passes are 5 tokens wide


def load(offload: OffloadConfig | None = None) -> MoEOffloadedMixtral:
    # torch kernels: the CPU library's fused native calls are not aten ops, which the recording capture cannot replay
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch", offload=offload)


@pytest.fixture(scope="module")
def greedy():
    model = load()
    try:
        return {p: model.generate(torch.tensor([model.tokenizer.encode(p)]), max_new_tokens=NEW_TOKENS,
                                  do_sample=False) for p in PROMPTS}
    finally:
        model.close()


class Spy:
    """Counts the captured decode function's eager runs (warm-up and capture only, once captured), the widths of
    the decode passes, and the tokens that reach the expert computation (after the backend drops unreal ones)."""

    def __init__(self, model: MoEOffloadedMixtral) -> None:
        self.inner_calls = 0
        self.widths: list[int] = []
        self.routed = 0
        decoder, runner, backend = on_device(model.model), model.runner, model.experts
        forward_pass, route_and_forward = runner.forward_pass, backend._route_and_forward

        def inner(*args):  # the logits leave as host tensors: generate reads each pass's tokens
            self.inner_calls += 1
            return decoder(*args).as_subclass(torch.Tensor)

        def spy_pass(ids, positions, cache, cache_position, token_mask, phase, **kwargs):
            if phase == "decode":
                self.widths.append(ids.shape[1])
            return forward_pass(ids, positions, cache, cache_position, token_mask, phase, **kwargs)

        def spy_route(layer, x, *args):
            if model.stats.phase == "decode":
                self.routed += x.shape[0]
            return route_and_forward(layer, x, *args)

        self.inner = inner
        runner.forward_pass, backend._route_and_forward = spy_pass, spy_route


def captured(offload: OffloadConfig | None = None):
    model = load(offload)
    graphs = model.capture_decode(capture_factory=TraceCapture)
    spy = Spy(model)
    graphs.inner = spy.inner
    model.use_backend(HostArgs(model.experts))  # the backend between the pieces (test_compile_cuda_graphs)
    return model, graphs, spy


@pytest.mark.parametrize("fillers_real", [False, True], ids=["fillers-masked", "fillers-real"])
@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=6)], ids=["resident", "lru"])
def test_drafted_passes_replay_a_captured_step_and_keep_the_greedy_tokens(greedy, offload, fillers_real, monkeypatch):
    """Both prompts: the first call captures the one-token step and the 5-wide verify step (two eager runs each:
    warm-up and capture); after that no pass runs eagerly, every decode pass replays, drafted passes are 5 wide,
    and the tokens are the eager plain greedy ones. Fillers never reach an expert, unless the backend counts as
    traced through (the whole-graph branch, forced here), which computes them as real tokens: same tokens."""
    if fillers_real:
        monkeypatch.setattr(lookup, "traces_through", lambda experts: True)
    model, graphs, spy = captured(offload)
    layers = model.config.num_hidden_layers
    try:
        for i, prompt in enumerate(PROMPTS):
            ids = torch.tensor([model.tokenizer.encode(prompt)])
            model.stats.reset()
            spy.widths, spy.routed, replays = [], 0, graphs.replays
            got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=DRAFT)
            assert torch.equal(got, greedy[prompt]), prompt
            s = model.stats
            assert s.accepted_tokens > 0 and spy.widths.count(1 + DRAFT) > 0
            assert set(spy.widths) <= {1, 1 + DRAFT}
            assert s.decode.steps == len(spy.widths) == graphs.replays - replays
            assert graphs.captures == 2 and spy.inner_calls == 4 and graphs.eager_calls == 0, f"call {i}"
            real = s.decode.tokens  # each pass's last token and draft, no filler
            assert spy.routed == layers * (sum(spy.widths) if fillers_real else real)
            assert sum(spy.widths) > real  # (so the count above tells the branches apart)
        assert sorted(k[1] for k in graphs.steps) == [(1, 1, model.config.hidden_size),
                                                     (1, 1 + DRAFT, model.config.hidden_size)]
        assert graphs.refused is None
        device_part = model.experts.compute.graphs if offload is not None else None
        if device_part is not None:  # the backend's own device part replays for every real-token count
            assert device_part.replays > 0 and not device_part.refused and device_part.eager_layers == 0
    finally:
        model.close()


@pytest.mark.parametrize(("policy", "transport"), [("finemoe", "random-delay"), ("expertflow", "random-delay"),
                                                   ("duoserve", "sync")])
def test_every_kind_of_policy_keeps_the_greedy_tokens_through_the_captured_verify_step(greedy, policy, transport):
    """Predictors that read the pass's embeddings (finemoe), its token counts (expertflow) or its routing
    (duoserve), with copies landing late: the captured verify step keeps the greedy tokens. (fiddler's CPU compute
    is left out: with kernels="torch" its CPU experts round differently from the resident ones even eagerly.)"""
    model, graphs, spy = captured(OffloadConfig(policy=policy, gpu_expert_slots=6, transport=transport,
                                                random_delay_ms=0.3, seed=1))
    try:
        prompt = PROMPTS[0]
        got = model.generate(torch.tensor([model.tokenizer.encode(prompt)]), max_new_tokens=NEW_TOKENS,
                             do_sample=False, prompt_lookup_num_tokens=DRAFT)
    finally:
        model.close()
    assert torch.equal(got, greedy[prompt]), f"{policy}/{transport}"
    assert model.stats.accepted_tokens > 0 and 1 + DRAFT in spy.widths
    assert graphs.captures == 2 and graphs.eager_calls == 0 and graphs.refused is None


def test_at_the_end_of_the_cache_fillers_are_clamped_into_it():
    """A call filling the model's whole context (the kept cache is max_position_embeddings long, no bucket room):
    the 11-wide passes near its end put their fillers on the cache's last position; short calls verify drafts
    longer than they may keep. Every call gives the greedy tokens."""
    ref = load()
    model, graphs, spy = captured()
    words = model.tokenizer.encode(PROMPTS[0])
    limit = model.config.max_position_embeddings
    calls = [(torch.tensor([(words * 100)[:limit - 12]]), 12), *[(torch.tensor([words]), n) for n in (2, 3, 7)]]
    try:
        for ids, new_tokens in calls:
            want = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            model.stats.reset()
            got = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, prompt_lookup_num_tokens=10)
            assert torch.equal(got, want), (ids.shape, new_tokens)
            if new_tokens == 12:
                assert graphs.step.cache.max_len == limit and 11 in spy.widths and model.stats.draft_tokens > 0
    finally:
        ref.close()
        model.close()
    assert graphs.eager_calls == 0 and graphs.refused is None


def test_an_eager_decode_step_verifies_each_draft_at_its_own_width(greedy):
    model = load()
    widths: list[int] = []
    forward_pass = model.runner.forward_pass

    def spy_pass(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return forward_pass(ids, *args, **kwargs)
    model.runner.forward_pass = spy_pass
    prompt = PROMPTS[0]
    try:
        got = model.generate(torch.tensor([model.tokenizer.encode(prompt)]), max_new_tokens=NEW_TOKENS,
                             do_sample=False, prompt_lookup_num_tokens=10)
    finally:
        model.close()
    assert torch.equal(got, greedy[prompt])
    assert sum(widths[1:]) == model.stats.decode.tokens and max(widths[1:]) > 1  # no filler computed


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=6)], ids=["resident", "lru"])
def test_compiled_decode_compiles_the_verify_width_once(greedy, offload, caplog):
    """compile=True without graphs: drafted passes are one more shape for dynamo per cache length (resident: one
    whole graph more; offloaded: the layer frames once more, the masked backend call's sizes symbolic), not one
    per draft length; then nothing recompiles and no frame is left eager by dynamo's recompile limit; the tokens
    stay greedy."""
    def run(num_tokens: int | None) -> tuple[dict[str, torch.Tensor], int]:
        torch._dynamo.reset()
        counters.clear()
        out = {p: model.generate(torch.tensor([model.tokenizer.encode(p)]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, prompt_lookup_num_tokens=num_tokens) for p in PROMPTS}
        return out, counters["stats"]["unique_graphs"]

    model = load(offload)
    model.compile_decode(backend="eager")
    try:
        _, plain = run(None)  # (no bucketed cache without graphs: each prompt's cache length compiles anew)
        with caplog.at_level(logging.WARNING):
            first, graphs = run(DRAFT)
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model.generate(torch.tensor([model.tokenizer.encode(PROMPTS[0])]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, prompt_lookup_num_tokens=DRAFT)
    finally:
        model.close()
        torch._dynamo.reset()
    assert all(torch.equal(first[p], greedy[p]) for p in PROMPTS) and torch.equal(again, greedy[PROMPTS[0]])
    assert model.stats.accepted_tokens > 0
    assert "recompile_limit" not in caplog.text and "cache_size_limit" not in caplog.text
    # resident 2 / 4 graphs; lru 15 / 32 here (a graph per draft length would be far more)
    assert graphs == 2 * plain if offload is None else plain < graphs < 3 * plain, (plain, graphs)


def test_pass_inputs_put_fillers_past_the_draft_and_inside_the_cache():
    tokens = torch.tensor([7, 8, 9])
    ids, positions, cache_position, mask = pass_inputs(tokens, 10, 6, 2, 14, False, torch.device("cpu"))
    assert ids.tolist() == [[7, 8, 9, 9, 9, 9]]
    assert cache_position.tolist() == [10, 11, 12, 13, 13, 13]  # clamped to the cache's last position
    assert positions.tolist() == [[8, 9, 10, 11, 11, 11]]  # left padding does not count
    assert mask.tolist() == [[True, True, True, False, False, False]] and mask.dtype == torch.bool
    assert pass_inputs(tokens, 10, 6, 2, 14, True, torch.device("cpu"))[3].all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")
@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_prompt_lookup_replays_the_verify_graph_on_a_gpu(policy):
    """cuda_graphs=True: the tokens are the same model's plain greedy ones (fp16: should the 5-wide pass round a
    near-tie the other way, lookup's docstring allows it; this prompt is expected to have none) and the drafted
    passes replay a captured step (resident: one whole graph, fillers computed; lru: pieces around the scheduler,
    fillers masked)."""
    offload = OffloadConfig(policy=policy, gpu_expert_slots=None if policy == "resident" else 24)
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), device="cuda", dtype=torch.float16,
                                                offload=offload, cuda_graphs=True)
    try:
        ids = torch.tensor([model.tokenizer.encode(PROMPTS[0])], device="cuda")
        want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=DRAFT)
        graphs = model.runner.decode_fn
        replays = graphs.replays
        model.stats.reset()
        again = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=DRAFT)
    finally:
        model.close()
    assert graphs.refused is None, graphs.refused
    assert torch.equal(got, want) and torch.equal(again, want)
    assert model.stats.accepted_tokens > 0
    assert graphs.captures == 2 and graphs.eager_calls == 0
    assert graphs.replays - replays == model.stats.decode.steps
    assert any(k[1][1] == 1 + DRAFT for k in graphs.steps)
