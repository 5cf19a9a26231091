"""Prompt lookup in the serving engine (``ContinuousEngine(prompt_lookup=N)``, moeflow.engine.continuous_lookup), in
process: a greedy request decoding alone gets generate's greedy tokens (and the undrafted engine's) with drafts
really accepted, resident, offloaded and with captured decode steps (drafted passes replaying their own: more in
test_engine_lookup_graphs); stop tokens, stop checks and max_tokens cut inside an accepted draft where plain
decoding cuts; rejected drafts' keys never stay valid (checked before every iteration and in the rows the prefix
cache keeps); two decoding requests, a prefill beside a decoding one, sampling and penalties are not drafted;
latent (MLA) rows draft too; hybrid models are refused."""

from __future__ import annotations

import threading

import pytest
import torch
from test_serve_graphs import captured
from tiny_hybrid import QWEN3_NEXT, make_checkpoint

from moeflow import MoEModel, MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.sequence import EngineListener

TIMEOUT_S = 120
NEW = 40
PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", "1 2 3 4 5 6 7 8 9 1 2 3 4",
           "The sequence of the string is the")


@pytest.fixture(scope="module")
def model():
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path())


@pytest.fixture(scope="module")
def offloaded():
    """A few of the 32 experts in slots, LRU: a verify pass needs the union of its tokens' experts."""
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                               offload=OffloadConfig(gpu_expert_slots=6, policy="lru"))


def greedy(model, ids: list[int], n: int = NEW, **kw) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=[],
                          **kw)[0, len(ids):].tolist()


class Passes(EngineListener):
    """Each pass's (phase, batch, real tokens), and how many tokens ``seq`` (the first request) had before it."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int, int]] = []
        self.before: list[int] = []
        self.seq = None

    def on_pass(self, phase: str, batch: int, tokens: int, seconds: float) -> None:
        self.passes.append((phase, batch, tokens))
        self.before.append(len(self.seq.generated))

    def groups(self) -> list[list[int]]:
        """The first request's tokens as its passes emitted them (a drafted pass: its kept drafts, then the
        model's own token); passes that emitted none of them left out."""
        gen = self.seq.generated
        cuts = [*self.before, len(gen)]
        return [gen[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def keys_match_fed_tokens(engine: ContinuousEngine) -> list[str]:
    """Check, before every iteration, that each decoding row's valid positions are exactly its fed tokens'; the
    list the violations go into (the engine thread would swallow an assert)."""
    bad: list[str] = []
    cache, iterate = engine.cache, engine._iterate

    def checked() -> None:
        for s in engine._running:
            if s.prefilled == len(s.prompt_ids) and s.row is not None:
                fed = len(s.fed_tokens())
                if cache.valid[s.row].tolist() != [p < fed for p in range(cache.max_len)]:
                    bad.append(f"row {s.row}: {int(cache.valid[s.row].sum())} valid, {fed} fed")
                if engine.history is not None and engine.history.ids[s.row, fed:].any():
                    bad.append(f"row {s.row}: token history past its {fed} fed tokens")
        iterate()

    engine._iterate = checked
    return bad


def idle_rows_hold_their_tokens(engine: ContinuousEngine) -> None:
    """Each idle row the prefix cache keeps has valid keys exactly at its held tokens' positions."""
    for row in range(engine.cache.rows):
        held = engine.prefix.held(row)
        if held is not None:
            assert engine.cache.valid[row].tolist() == [p < len(held) for p in range(engine.cache.max_len)], row


def run(model, requests: list[tuple[list[int], SamplingParams]], lookup: int | None = 4, rows: int = 2, **kw
        ) -> tuple[list, Passes, ContinuousEngine]:
    """The requests, all submitted before the engine starts (so they prefill together), through an engine
    drafting ``lookup`` tokens: their sequences (finished), the pass log and the engine (stopped)."""
    log = Passes()
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=rows), listener=log,
                              prompt_lookup=lookup, **kw)
    bad = keys_match_fed_tokens(engine)
    seqs = [engine.submit(p, params) for p, params in requests]
    log.seq = seqs[0]
    engine.start()
    try:
        for s in seqs:
            s.result(TIMEOUT_S)
    finally:
        engine.stop()
    assert [s.finish_reason for s in seqs if s.finish_reason == "error"] == [], [s.error for s in seqs]
    assert bad == []
    idle_rows_hold_their_tokens(engine)
    assert not_drafted_beside_a_prefill(log)
    return seqs, log, engine


def not_drafted_beside_a_prefill(log: Passes) -> bool:
    """No drafted pass (more tokens than sequences) in an iteration that prefilled: an iteration's decode pass
    comes right after its prefill pass."""
    return all(not (a[0] == "prefill" and b[0] == "decode" and b[2] > b[1])
               for a, b in zip(log.passes, log.passes[1:], strict=False))


def ids_of(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


@pytest.mark.parametrize("which", ["resident", "lru", "expertflow"])
def test_a_greedy_request_alone_gets_generates_tokens_with_drafts_accepted(which, request):
    model = request.getfixturevalue("model" if which == "resident" else "offloaded") if which != "expertflow" else \
        MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                            offload=OffloadConfig(gpu_expert_slots=16, policy="expertflow"))
    accepted = 0
    for text in PROMPTS:
        ids = ids_of(model, text)
        want = greedy(model, ids)
        (plain,), plain_log, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))], lookup=None)
        model.stats.reset()
        (seq,), log, engine = run(model, [(ids, SamplingParams(max_new_tokens=NEW))])
        assert seq.generated == plain.generated == want and seq.finish_reason == "length"
        assert engine.history is not None or which != "expertflow"  # (the token history path is the one tested)
        decode = [p for p in log.passes if p[0] == "decode"]
        # every pass emits its kept drafts and one token of its own; each drafted pass feeds 1 + its draft
        assert len(decode) == NEW - 1 - seq.accepted_tokens
        assert sum(t - 1 for _, _, t in decode) == seq.draft_tokens >= seq.accepted_tokens
        assert len(plain_log.passes) == NEW  # (the undrafted engine: a prefill, then a pass per token)
        assert (model.stats.draft_tokens, model.stats.accepted_tokens) == (seq.draft_tokens, seq.accepted_tokens)
        accepted += seq.accepted_tokens
        assert any(len(g) > 1 for g in log.groups()) == (seq.accepted_tokens > 0)
    assert accepted > NEW  # the embedded model repeats itself: drafts are kept (else equal tokens prove little)


def cut_in_a_draft(log: Passes, uncut: dict[int, tuple[int, int]], j: int) -> bool:
    """Whether the reply (of ``j + 1`` tokens) ended inside the kept drafts of its last pass, a drafted one:
    that pass emitted fewer tokens than it does uncut (``uncut``: position -> (offset in its pass, tokens the
    pass emitted))."""
    offset, emitted = uncut[j]
    return log.passes[-1][2] > 1 and len(log.groups()[-1]) == offset + 1 < emitted


def test_stops_and_max_tokens_cut_inside_an_accepted_draft(model):
    """A stop token (generate's eos), a stop check (what stop strings use) and max_tokens that fall on a token a
    drafted pass kept (not its last) end the reply at that token, as plain decoding does."""
    cases = 0
    for text in PROMPTS:
        ids = ids_of(model, text)
        want = greedy(model, ids)
        (seq,), log, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))])
        assert seq.generated == want
        at, uncut = 0, {}
        for group in log.groups():
            uncut.update({at + k: (k, len(group)) for k in range(len(group))})
            at += len(group)
        inside = [j for j, (k, n) in uncut.items() if k < n - 1]  # kept drafts that are not their pass's last
        firsts = [j for j in inside if want[j] not in want[:j]]  # a stop token ends the reply at its first
        pairs = [j for j in inside if j > 0 and all(want[i - 1:i + 1] != want[j - 1:j + 1] for i in range(1, j))]
        for j in firsts[:2]:
            eos = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=[want[j]])[0, len(ids):].tolist()
            (stopped,), slog, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW, stop_token_ids=(want[j],)))])
            assert stopped.generated == eos == want[: j + 1] and stopped.finish_reason == "stop"
            assert cut_in_a_draft(slog, uncut, j)
            cases += 1
        for j in pairs[:2]:
            pair = want[j - 1:j + 1]
            clog = Passes()
            engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=1), listener=clog,
                                      prompt_lookup=4)
            bad = keys_match_fed_tokens(engine)
            s = engine.submit(ids, SamplingParams(max_new_tokens=NEW), stop_check=lambda g, p=pair: g[-2:] == p)
            clog.seq = s
            engine.start()
            try:
                s.result(TIMEOUT_S)
            finally:
                engine.stop()
            assert s.generated == want[: j + 1] and s.finish_reason == "stop" and bad == []
            assert cut_in_a_draft(clog, uncut, j)
            idle_rows_hold_their_tokens(engine)
            cases += 1
        for j in inside[:3]:  # (a draft never runs past max_tokens: the pass drafts fewer, and keeps them all)
            (cut,), clog, _ = run(model, [(ids, SamplingParams(max_new_tokens=j + 1))])
            assert cut.generated == want[: j + 1] and cut.finish_reason == "length"
    assert cases >= 4


def test_two_decoding_requests_are_not_drafted_and_the_one_left_is(model):
    """Prefilled together, both decode in the same passes (never drafted: the short one never is); once the short
    one has finished, the long one drafts. Both replies are generate's."""
    short, long = ids_of(model, PROMPTS[0]), ids_of(model, PROMPTS[1])
    requests = [(short, SamplingParams(max_new_tokens=10)), (long, SamplingParams(max_new_tokens=NEW))]
    (a, b), log, _ = run(model, requests, prefill_chunk=128)
    assert a.generated == greedy(model, short, 10) and b.generated == greedy(model, long)
    assert a.draft_tokens == 0 and b.accepted_tokens > 0
    assert log.passes[0] == ("prefill", 2, len(short) + len(long))
    assert log.passes[1:10] == [("decode", 2, 2)] * 9  # (the short one's 9 passes: undrafted)


def test_a_request_decoding_while_another_prefills_is_not_drafted_then(model):
    """A drafts alone; B arrives with a prompt read in 8-token chunks over several iterations, during which A's
    passes are plain; after B's prefill both decode (plain); when B is done, A drafts again."""
    a_ids, b_ids = ids_of(model, PROMPTS[1]), ids_of(model, PROMPTS[0])
    log = Passes()
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=2), listener=log, prefill_chunk=8,
                              prompt_lookup=4)
    bad = keys_match_fed_tokens(engine)
    later: list = []

    ended = threading.Event()

    def on_event(token, reason):  # (the engine thread)
        if token is not None and len(a.generated) == 6:
            later.append(engine.submit(b_ids, SamplingParams(max_new_tokens=3)))
        if reason is not None:
            ended.set()

    a = engine.submit(a_ids, SamplingParams(max_new_tokens=NEW), on_event=on_event)
    log.seq = a
    engine.start()
    try:
        assert ended.wait(TIMEOUT_S)  # (b is submitted before a ends)
        later[0].result(TIMEOUT_S)
    finally:
        engine.stop()
    (b,) = later
    assert a.generated == greedy(model, a_ids) and b.generated == greedy(model, b_ids, 3) and bad == []
    assert not_drafted_beside_a_prefill(log)
    chunks = -(-len(b_ids) // 8)
    first = next(i for i, p in enumerate(log.passes) if p[0] == "prefill" and ("decode", 1, 1) in log.passes[:i])
    assert log.passes[first:first + 2 * chunks:2] == [("prefill", 1, 8)] * (chunks - 1) + [
        ("prefill", 1, len(b_ids) - 8 * (chunks - 1))]
    # a's plain passes, then both (b's first token came from its last chunk)
    assert log.passes[first + 1:first + 2 * chunks:2] == [("decode", 1, 1)] * (chunks - 1) + [("decode", 2, 2)]
    assert any(t > 1 for _, _, t in log.passes[:first]) and any(t > 1 for _, _, t in log.passes[first + 2 * chunks:])


@pytest.mark.parametrize("params", [dict(do_sample=True, temperature=0.8, seed=3), dict(repetition_penalty=1.3),
                                    dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                                    dict(logit_bias=((32, 2.0),))], ids=lambda p: next(iter(p)))
def test_sampling_penalties_and_bias_are_not_drafted(model, params):
    ids = ids_of(model, PROMPTS[1])
    want = run(model, [(ids, SamplingParams(max_new_tokens=24, **params))], lookup=None)[0][0].generated
    (seq,), log, _ = run(model, [(ids, SamplingParams(max_new_tokens=24, **params))])
    assert seq.generated == want and seq.draft_tokens == 0
    assert all(t == b for _, b, t in log.passes[1:])  # one token per sequence and pass
    (greedy_seq,), _, _ = run(model, [(ids, SamplingParams(max_new_tokens=24))])
    assert greedy_seq.draft_tokens > 0  # (the same prompt, greedy: drafted)


def test_captured_decode_steps_with_drafted_passes_between_them():
    """Decode steps captured (the CPU stand-in of CUDA graphs): passes without a draft replay the one-token step,
    drafted ones a second step, 5 tokens wide (without a warm-up: both captured on their first pass); none runs
    eagerly; the tokens are generate's (more in test_engine_lookup_graphs)."""
    plain = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    ids = ids_of(plain, PROMPTS[0])
    want = greedy(plain, ids)
    plain.close()
    model, graphs = captured(None)
    try:
        (seq,), log, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))])
    finally:
        model.close()
    assert seq.generated == want and seq.accepted_tokens > 0
    assert graphs.refused is None and graphs.captures == 2 and graphs.eager_calls == 0
    assert graphs.replays == len([p for p in log.passes if p[0] == "decode"])
    assert sorted(k[1][1] for k in graphs.steps) == [1, 5]  # the steps' embeds [1, T, H]


def test_arguments_and_linear_attention_models_are_refused(model, tmp_path):
    cache = SlotKVCache.for_model(model, 64, max_rows=1)
    for kw, match in ((dict(prompt_lookup=-1), "prompt_lookup must be"),
                      (dict(prompt_lookup=4, max_matching_ngram_size=0), "max_matching_ngram_size must be")):
        with pytest.raises(ValueError, match=match):
            ContinuousEngine(model, cache, **kw)
    assert ContinuousEngine(model, cache, prompt_lookup=0).lookup is None  # 0: off
    path, _ = make_checkpoint(tmp_path, "qwen3_next", **QWEN3_NEXT["interval2-gqa-dense-first"])
    hybrid = MoEModel.from_pretrained(path)
    try:
        with pytest.raises(ValueError, match="qwen3_next has linear-attention layers"):
            ContinuousEngine(hybrid, SlotKVCache.for_model(hybrid, 64, max_rows=1), prompt_lookup=4)
    finally:
        hybrid.close()


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa"])
def test_latent_rows_draft_with_the_same_tokens(tmp_path, kind):
    """Multi-head latent attention rows (DeepSeek-V3; GLM-5's sparse selection over the latents' indexer keys):
    a drafted pass writes and invalidates latent vectors as full heads; the tokens are generate's."""
    from test_latent_serve import checkpoint

    model = MoEModel.from_pretrained(checkpoint(tmp_path, kind, seed=13), kernels="torch")
    try:
        ids = [5, 6, 7, 8, 9] * 4
        want = greedy(model, ids, 24)
        (seq,), _, _ = run(model, [(ids, SamplingParams(max_new_tokens=24))])
    finally:
        model.close()
    assert seq.generated == want and seq.draft_tokens > 0
    assert seq.accepted_tokens > 0 or kind == "glm_moe_dsa"  # (this GLM-5 rejects every draft: invalidation only)
