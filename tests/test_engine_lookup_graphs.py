"""Prompt lookup in the serving engine with captured decode passes (moeflow.engine.continuous_lookup, ``graphs``).

On the CPU the steps are captured by test_compile_cuda_graphs' :class:`TraceCapture` (a host read or a
data-dependent shape while capturing is refused; replays re-run the recorded ops on the recorded tensors, as a
graph does). A drafted pass is one shape, 1 + DRAFT tokens on a :class:`SlotVerifyView`, captured once per key
bucket (the smallest by ``warm_up``) and replayed: after the warm-up no pass runs eagerly and requests within the
first bucket capture nothing, over many requests; the tokens are eager greedy ``generate``'s (resident, lru,
expertflow); fillers never reach an expert (unless the backend counts as traced through: then they are computed,
with the same tokens) and never become valid keys or history; rejected drafts leave a row's valid keys and token
history exactly as an engine without lookup leaves them; latent (MLA, DSA) rows replay their own verify step.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_lookup import PROMPTS, keys_match_fed_tokens
from test_serve_graphs import captured

from moeflow import MoEModel, MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine import continuous_lookup
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.continuous_lookup import verify_inputs
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.sequence import EngineListener
from moeflow.engine.slot_verify import LatentSlotVerifyView, SlotVerifyView

TIMEOUT_S = 120
NEW = 40
DRAFT = 4  # prompt_lookup: verify passes are 5 tokens wide
MAX_LEN = 512
OFFLOADS = {"resident": None, "lru": OffloadConfig(policy="lru", gpu_expert_slots=6),
            "expertflow": OffloadConfig(policy="expertflow", gpu_expert_slots=8)}


def long_prompt(model) -> list[int]:
    """A repetitive prompt whose reply crosses 256 keys: its drafted passes move to the 512-key bucket."""
    return (model.tokenizer.encode(PROMPTS[0]) * 20)[:240]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Each prompt's eager greedy ``generate`` tokens, all experts resident (torch kernels, as the captured)."""
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    try:
        prompts = [model.tokenizer.encode(p) for p in PROMPTS] + [long_prompt(model)]
        return {tuple(p): model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                         eos_token_id=[])[0, len(p):].tolist() for p in prompts}
    finally:
        model.close()


class Log(EngineListener):
    """Each pass's (phase, batch, real tokens)."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int, int]] = []

    def on_pass(self, phase: str, batch: int, tokens: int, seconds: float) -> None:
        self.passes.append((phase, batch, tokens))


class Spy:
    """The widths of the decode passes and the tokens that reach the expert computation in decode passes (after
    the backend drops unreal ones)."""

    def __init__(self, model) -> None:
        self.widths: list[int] = []
        self.routed = 0
        runner, backend = model.runner, model.runner.backend.backend  # (inside test_serve_graphs' HostArgs)
        forward_pass, route_and_forward = runner.forward_pass, backend._route_and_forward

        def spy_pass(ids, *args, **kwargs):
            if args[4] == "decode":
                self.widths.append(ids.shape[1])
            return forward_pass(ids, *args, **kwargs)

        def spy_route(layer, x, *args):
            if model.stats.phase == "decode":
                self.routed += x.shape[0]
            return route_and_forward(layer, x, *args)

        runner.forward_pass, backend._route_and_forward = spy_pass, spy_route


def engine_for(model, lookup: int | None = DRAFT, max_len: int = MAX_LEN) -> tuple[ContinuousEngine, Log, list[str]]:
    """A warmed-up engine of two rows drafting ``lookup`` tokens, its pass log and its row checker's findings."""
    log = Log()
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, max_len, max_rows=2), listener=log,
                              prompt_lookup=lookup)
    engine.warm_up()
    bad = keys_match_fed_tokens(engine)
    return engine, log, bad


def serve_one_by_one(engine: ContinuousEngine, prompts: list[list[int]], new: int = NEW) -> list:
    """Each prompt alone (so every decode pass may draft), one after the other; their finished sequences."""
    engine.start()
    try:
        seqs = []
        for p in prompts:
            seqs.append(engine.submit(p, SamplingParams(max_new_tokens=new)))
            seqs[-1].result(TIMEOUT_S)
    finally:
        engine.stop()
    assert [s.finish_reason for s in seqs] == ["length"] * len(seqs), [s.error for s in seqs]
    return seqs


@pytest.mark.parametrize("which", list(OFFLOADS))
def test_drafted_passes_replay_the_verify_step_with_greedy_tokens(which, reference):
    """warm_up captures the one-token steps (batch 1, 2) and the 5-wide verify step at 256 keys; then the short
    prompts, twice, capture nothing and run nothing eagerly: every decode pass replays a step, drafted ones at
    5 tokens (shorter drafts padded), and each reply is generate's greedy one. An offload backend's device part
    is captured for every real-token count by the warm-up too."""
    model, graphs = captured(OFFLOADS[which])
    try:
        engine, log, bad = engine_for(model)
        assert (engine.history is not None) == (which == "expertflow")
        assert graphs.captures == 3 and graphs.refused is None
        hidden = model.config.hidden_size
        assert sorted(k[1] for k in graphs.steps) == [(1, 1, hidden), (1, 1 + DRAFT, hidden), (2, 1, hidden)]
        device_graphs = model.experts.device_graphs if which != "resident" else None
        device_captures = device_graphs.captures if device_graphs is not None else 0
        spy = Spy(model)
        replays, eager = graphs.replays, graphs.eager_calls
        prompts = [model.tokenizer.encode(p) for p in PROMPTS] * 2
        seqs = serve_one_by_one(engine, prompts)
    finally:
        model.close()
    assert [s.generated for s in seqs] == [reference[tuple(p)] for p in prompts]
    assert bad == []
    decode = [p for p in log.passes if p[0] == "decode"]
    assert graphs.eager_calls == eager == 0 and graphs.captures == 3  # nothing captured after the warm-up
    assert graphs.replays - replays == len(decode) == len(spy.widths)
    drafted = [t for _, _, t in decode if t > 1]
    assert sum(s.accepted_tokens for s in seqs) > NEW and len(drafted) > 0
    assert set(spy.widths) == {1, 1 + DRAFT} and spy.widths.count(1 + DRAFT) == len(drafted)
    assert min(drafted) < 1 + DRAFT  # some drafts were shorter: their passes were padded with fillers
    if device_graphs is not None:
        assert device_graphs.captures == device_captures and device_graphs.eager_layers == 0
        assert device_graphs.refused == {} and {2, 3, 4, 5} <= set(device_graphs.buckets)


def test_captures_stay_bounded_over_many_requests(reference):
    """Many requests, short and long (a reply crossing 256 keys), alone and two at once: one more verify step for
    the 512-key bucket (and at most one more one-token step), captured on the first long request; a second round
    of the same requests captures nothing."""
    model, graphs = captured(OFFLOADS["lru"])
    short = [model.tokenizer.encode(p) for p in PROMPTS]
    prompts = [*short, long_prompt(model), *short]
    try:
        engine, log, bad = engine_for(model)
        verify_views = engine.lookup.views
        engine.start()
        try:
            rounds = []
            for _ in range(2):
                seqs = []
                for p in prompts:
                    seqs.append(engine.submit(p, SamplingParams(max_new_tokens=NEW)))
                    seqs[-1].result(TIMEOUT_S)
                pair = [engine.submit(p, SamplingParams(max_new_tokens=NEW)) for p in short[:2]]  # (not drafted)
                seqs += [s.result(TIMEOUT_S) and s for s in pair]
                rounds.append((graphs.captures, seqs))
        finally:
            engine.stop()
        steps = [step.cache for step in graphs.steps.values()]
    finally:
        model.close()
    assert bad == [] and graphs.eager_calls == 0 and graphs.refused is None
    (first, seqs1), (second, seqs2) = rounds
    # the warm-up's three, then the 5-wide step at 512 keys (and the one-token one, if a pass past 256 keys drafted
    # nothing), every step kept
    assert first == second == len(steps) <= 3 + 2
    assert {(type(view).__name__, view.key_len) for view in steps} >= {("SlotVerifyView", 256),
                                                                       ("SlotVerifyView", 512)}
    assert sorted(verify_views) == [256, 512] and all(isinstance(v, SlotVerifyView) for v in verify_views.values())
    want = [reference[tuple(p)] for p in prompts + short[:2]]
    assert [s.generated for s in seqs1] == [s.generated for s in seqs2] == want
    assert seqs1[len(short)].accepted_tokens > 0  # the long one drafted, past 256 keys too
    assert any(t > 1 for phase, _, t in log.passes if phase == "decode")


@pytest.mark.parametrize("fillers_real", [False, True], ids=["fillers-masked", "fillers-real"])
def test_fillers_never_reach_the_experts_nor_become_valid(fillers_real, reference, monkeypatch):
    """The experts compute only the real tokens of every decode pass (each pass's last token and its draft),
    though the drafted passes are wider; a backend the capture counts as traced through (forced here) computes
    the fillers too, with the same tokens. Either way no filler's key becomes valid (nor, expertflow, its token
    history). (Only a resident backend is traced through: lru stands in for it, as no predictor reads its history.)"""
    if fillers_real:
        monkeypatch.setattr(continuous_lookup, "traces_through", lambda experts: True)
    model, graphs = captured(OFFLOADS["lru" if fillers_real else "expertflow"])
    try:
        engine, log, bad = engine_for(model)
        spy = Spy(model)
        model.stats.reset()
        prompts = [model.tokenizer.encode(p) for p in PROMPTS]
        seqs = serve_one_by_one(engine, prompts)
        layers = model.config.num_hidden_layers
    finally:
        model.close()
    assert [s.generated for s in seqs] == [reference[tuple(p)] for p in prompts]
    assert bad == [] and graphs.eager_calls == 0
    real = model.stats.decode.tokens
    assert real == sum(t for phase, _, t in log.passes if phase == "decode")
    assert sum(spy.widths) > real  # (fillers were there: the count below tells the branches apart)
    assert spy.routed == layers * (sum(spy.widths) if fillers_real else real)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa"])
def test_latent_rows_replay_the_verify_step(tmp_path, kind):
    """Multi-head latent attention rows (DeepSeek-V3; GLM-5's sparse selection over the latents' indexer keys):
    the verify step captured on a latent view writes and reads latent vectors; the tokens are generate's."""
    from engine_helpers import captured_model
    from test_latent_serve import checkpoint

    path = checkpoint(tmp_path, kind, seed=13)
    ids = [5, 6, 7, 8, 9] * 4
    eager = MoEModel.from_pretrained(path, kernels="torch")
    try:
        want = eager.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[])
    finally:
        eager.close()
    model, graphs = captured_model(path)
    try:
        engine, _, bad = engine_for(model, max_len=256)
        (seq,) = serve_one_by_one(engine, [ids], 24)
    finally:
        model.close()
    assert seq.generated == want[0, len(ids):].tolist() and seq.draft_tokens > 0 and bad == []
    assert graphs.refused is None and graphs.eager_calls == 0 and graphs.captures == 3
    assert all(isinstance(v, LatentSlotVerifyView) for v in engine.lookup.views.values())


def row_state(engine: ContinuousEngine, seq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The finished ``seq``'s row as the prefix cache keeps it: (valid [max_len], history ids [max_len], keys of
    layer 0 at its valid positions)."""
    row = next(r for r in range(engine.cache.rows) if engine.prefix.held(r) == seq.fed_tokens())
    valid = engine.cache.valid[row].clone()
    return valid, engine.history.ids[row].clone(), engine.cache.k[0, row][:, valid].clone()


def test_rejected_drafts_leave_the_row_as_an_engine_without_lookup(reference):
    """The same requests through captured engines with and without lookup (expertflow: the token history is
    kept): drafts were rejected, and each finished row's valid keys and token history are exactly the undrafted
    engine's (its keys equal up to rounding: a 5-token pass computes them)."""
    states = {}
    for lookup in (None, DRAFT):
        model, graphs = captured(OFFLOADS["expertflow"])
        try:
            engine, _, bad = engine_for(model, lookup)
            prompts = [model.tokenizer.encode(p) for p in PROMPTS]
            engine.start()
            try:
                seqs = []
                for p in prompts:  # each finishes before the next: rows 0 and 1 are reused in turn
                    seqs.append(engine.submit(p, SamplingParams(max_new_tokens=NEW)))
                    seqs[-1].result(TIMEOUT_S)
                    states.setdefault(lookup, []).append(row_state(engine, seqs[-1]))
            finally:
                engine.stop()
        finally:
            model.close()
        assert bad == [] and graphs.eager_calls == 0
        assert [s.generated for s in seqs] == [reference[tuple(p)] for p in prompts]
        if lookup is not None:
            assert sum(s.draft_tokens - s.accepted_tokens for s in seqs) > 0  # rejected drafts
    for (valid, history, keys), (valid0, history0, keys0) in zip(states[DRAFT], states[None], strict=True):
        assert torch.equal(valid, valid0) and torch.equal(history, history0)
        torch.testing.assert_close(keys, keys0, rtol=1e-4, atol=1e-4)


def test_verify_inputs_put_fillers_past_the_draft_and_inside_the_row():
    ids, pos, real = verify_inputs(7, [8, 9], 10, 6, 14)
    assert ids.tolist() == [[7, 8, 9, 7, 7, 7]]
    assert pos.tolist() == [[10, 11, 12, 13, 13, 13]]  # clamped to the row's last position
    assert real.tolist() == [[True, True, True, False, False, False]]


def test_the_verify_view_marks_only_real_tokens_valid():
    """A filler on a position another filler shares, or past the draft: written, never valid; valid positions
    stay valid."""
    cache = SlotKVCache(1, 2, 8, 1, 2, torch.float32, "cpu")
    cache.valid[1, :3] = True
    view = SlotVerifyView(cache, 4, 8)
    view.load(torch.tensor([1]), torch.tensor([[True, True, False, False]]))
    pos = torch.tensor([[5, 6, 7, 7]])
    view.mark_valid(pos, torch.ones_like(pos, dtype=torch.bool))
    assert cache.valid[1].tolist() == [True] * 3 + [False] * 2 + [True, True, False]
    assert not cache.valid[0].any()
    k = torch.arange(8, dtype=torch.float32).view(1, 1, 4, 2)
    keys, _ = view.update(0, k, k, pos)
    assert keys.shape == (1, 1, 8, 2) and cache.k[0, 1, 0, 5:7].tolist() == [[0, 1], [2, 3]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")
@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_served_drafts_replay_the_verify_graph_on_a_gpu(policy):
    """cuda_graphs on (fp16): the drafting engine's replies are the undrafted engine's (should a 5-wide pass round
    a near-tie the other way, lookup's docstring allows it; these prompts are expected to have none), and after
    the warm-up no pass runs eagerly and nothing more is captured (resident: one whole graph, fillers computed;
    lru: pieces around the scheduler, fillers masked)."""
    offload = OffloadConfig(policy=policy, gpu_expert_slots=None if policy == "resident" else 24)
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), device="cuda", dtype=torch.float16,
                                                offload=offload, cuda_graphs=True)
    graphs = model.runner.decode_fn
    try:
        prompts = [model.tokenizer.encode(p) for p in PROMPTS]
        plain, _, _ = engine_for(model, None)
        want = [s.generated for s in serve_one_by_one(plain, prompts)]
        engine, log, bad = engine_for(model)
        captures = graphs.captures
        seqs = serve_one_by_one(engine, prompts)
    finally:
        model.close()
    assert graphs.refused is None, graphs.refused
    assert [s.generated for s in seqs] == want and bad == []
    assert sum(s.accepted_tokens for s in seqs) > 0 and any(t > 1 for _, _, t in log.passes)
    assert graphs.captures == captures and graphs.eager_calls == 0
