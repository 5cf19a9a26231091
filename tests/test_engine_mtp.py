"""MTP speculation in the serving engine (``ContinuousEngine(num_speculative_tokens=k)``,
moeflow.engine.continuous_mtp), in process on a tiny DeepSeek-V3 with one MTP layer: a greedy request alone gets
generate's greedy tokens and exactly generate(num_speculative_tokens=k)'s drafts (the MTP layer's cache in the
engine's rows is generate's), resident and offloaded; with drafts from the plain greedy tokens (an oracle, some
wrong), drafts are accepted and stop tokens, stop checks and max_tokens cut inside an accepted draft where plain
decoding cuts, one event per token; rejected keys never stay valid; concurrent, sampled and penalised requests are
not drafted; a prompt from the prefix cache still gets its greedy tokens; the refusals. ~25 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from mtp_helpers import make_mtp_checkpoint, reference_mtp_logits
from test_engine_lookup import keys_match_fed_tokens, run
from test_mtp import GLM_SHAPE, SHAPE

from moeflow import MoEModel, OffloadConfig
from moeflow.engine import continuous_mtp
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.kv_slots import SlotKVCache

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 24
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, the transformers model whose layer N is the MTP block, the MTP layer's own tensors)."""
    return make_mtp_checkpoint(tmp_path_factory.mktemp("engine_mtp"), seed=5, **dict(SHAPE))


@pytest.fixture(scope="module")
def path(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def model(path):
    return MoEModel.from_pretrained(path, mtp=True)


def prompt(seed: int, n: int = 9) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model, ids: list[int], n: int = NEW, **kw) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=[],
                          **kw)[0, len(ids):].tolist()


def mtp_run(model, requests, k: int = 3, **kw):
    return run(model, requests, lookup=None, num_speculative_tokens=k, **kw)


@pytest.mark.parametrize("offload", [None, "lru"])
def test_alone_greedy_tokens_and_drafts_are_the_mtp_layers(tiny, model, offload, monkeypatch):
    """The tokens of plain greedy decoding (and of generate with MTP drafts); each pass's first draft is the argmax
    of the fp32 reference MTP module over the sequence so far (so the MTP layer's cache in the engine's row holds
    every earlier position, whichever pass computed its hidden state); passes = tokens - kept drafts."""
    path, hf, own = tiny
    if offload is not None:
        model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy=offload, gpu_expert_slots=5))
    proposed: list[tuple[list[int], list[int]]] = []
    real = continuous_mtp.propose

    def recorded(drafter, row, tokens, k):
        proposed.append((list(tokens), draft := real(drafter, row, tokens, k)))
        return draft

    monkeypatch.setattr(continuous_mtp, "propose", recorded)
    for seed in (1, 5):
        ids = prompt(seed)
        want = greedy(model, ids)
        for k in (1, 3):
            assert greedy(model, ids, num_speculative_tokens=k) == want
            model.stats.reset()
            proposed.clear()
            (seq,), log, _ = mtp_run(model, [(ids, SamplingParams(max_new_tokens=NEW))], k=k)
            assert seq.generated == want and seq.finish_reason == "length"
            assert seq.draft_tokens == sum(len(d) for _, d in proposed) > 0
            assert (model.stats.draft_tokens, model.stats.accepted_tokens) == (seq.draft_tokens, seq.accepted_tokens)
            decode = [p for p in log.passes if p[0] == "decode"]
            assert len(decode) == NEW - 1 - seq.accepted_tokens
            assert sum(t - 1 for _, _, t in decode) == seq.draft_tokens
            assert len(proposed) == len(decode) - 2  # (not the first pass, beside the prefill; not the last: room)
            for tokens, draft in proposed:
                ref = reference_mtp_logits(hf, own, torch.tensor([tokens]))
                assert int(ref[-1].argmax()) == draft[0] and len(draft) == min(k, len(ids) + NEW - len(tokens) - 1)


def test_full_head_rows_glm(tmp_path, monkeypatch):
    """GLM-4.5's MTP layer (grouped-query attention: a full-head slotted cache of its own): generate's tokens, and
    each first draft the fp32 reference MTP module's argmax."""
    path, hf, own = make_mtp_checkpoint(tmp_path, seed=3, kind="glm4_moe", **dict(GLM_SHAPE))
    model = MoEModel.from_pretrained(path, mtp=True)
    proposed: list[tuple[list[int], int]] = []
    real = continuous_mtp.propose

    def recorded(drafter, row, tokens, k):
        draft = real(drafter, row, tokens, k)
        proposed.append((list(tokens), draft[0]))
        return draft

    monkeypatch.setattr(continuous_mtp, "propose", recorded)
    ids = prompt(2)
    (seq,), _, _ = mtp_run(model, [(ids, SamplingParams(max_new_tokens=16))], k=2)
    assert seq.generated == greedy(model, ids, 16) and seq.draft_tokens > 0 and proposed
    for tokens, first in proposed:
        assert int(reference_mtp_logits(hf, own, torch.tensor([tokens]))[-1].argmax()) == first


@pytest.fixture
def oracle(monkeypatch):
    """Drafts from the plain greedy reply ``want[0]`` (set by the test) after the prompt, every third one wrong."""
    want: list[list[int]] = []

    def propose(drafter, row, tokens, k):
        ids, reply = want[0]
        at = len(tokens) - len(ids)  # reply tokens so far
        return [(t + 1) % 97 if (at + j) % 3 == 2 else t for j, t in enumerate(reply[at:at + k])]

    monkeypatch.setattr(continuous_mtp, "propose", propose)
    return want


def test_oracle_drafts_accepted_and_cut_by_stops_and_max_tokens(model, oracle):
    ids = prompt(1)
    want = greedy(model, ids)
    oracle.append((ids, want))
    (seq,), log, _ = mtp_run(model, [(ids, SamplingParams(max_new_tokens=NEW))])
    assert seq.generated == want and 0 < seq.accepted_tokens < seq.draft_tokens
    groups = log.groups()
    assert any(len(g) > 2 for g in groups)
    at, inside = 0, []  # reply positions that a pass kept before its last token
    for g in groups:
        inside += [at + j for j in range(len(g) - 1)]
        at += len(g)
    firsts = [j for j in inside if want[j] not in want[:j]]
    assert firsts
    for j in firsts[:2]:  # a stop token inside an accepted draft
        (stopped,), _, _ = mtp_run(model, [(ids, SamplingParams(max_new_tokens=NEW, stop_token_ids=(want[j],)))])
        assert stopped.generated == want[: j + 1] and stopped.finish_reason == "stop"
    for j in inside[:3]:  # max_tokens
        (cut,), _, _ = mtp_run(model, [(ids, SamplingParams(max_new_tokens=j + 1))])
        assert cut.generated == want[: j + 1] and cut.finish_reason == "length"
    j = inside[1]  # a stop check (what stop strings use), with the events a stream sends: one per token
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=1), num_speculative_tokens=3)
    bad = keys_match_fed_tokens(engine)
    s = engine.submit(ids, SamplingParams(max_new_tokens=NEW), stop_check=lambda g: len(g) == j + 1)
    engine.start()
    try:
        events = list(s.events(TIMEOUT_S))
    finally:
        engine.stop()
    assert bad == [] and s.generated == want[: j + 1]
    assert events == [(t, None) for t in want[: j + 1]] + [(None, "stop")]


def test_concurrent_sampled_and_penalised_requests_are_not_drafted(tiny, model, monkeypatch):
    """Two requests decode together undrafted; once the short one is done the long one drafts, its MTP layer
    having caught up over the batched passes' positions (its first drafts: the reference module's argmax)."""
    _, hf, own = tiny
    proposed: list[tuple[list[int], int]] = []
    real = continuous_mtp.propose

    def recorded(drafter, row, tokens, k):
        draft = real(drafter, row, tokens, k)
        proposed.append((list(tokens), draft[0]))
        return draft

    monkeypatch.setattr(continuous_mtp, "propose", recorded)
    a, b = prompt(1), prompt(2, 12)
    (x, y), log, _ = mtp_run(model, [(a, SamplingParams(max_new_tokens=6)), (b, SamplingParams(max_new_tokens=NEW))],
                             prefill_chunk=64)
    assert x.generated == greedy(model, a, 6) and y.generated == greedy(model, b)
    assert x.draft_tokens == 0 and y.draft_tokens > 0  # (b drafts once it decodes alone)
    assert log.passes[1:6] == [("decode", 2, 2)] * 5
    assert proposed[0][0] == b + y.generated[:6]  # (its first draft after 5 batched passes and its own)
    for tokens, first in proposed:
        assert int(reference_mtp_logits(hf, own, torch.tensor([tokens]))[-1].argmax()) == first
    monkeypatch.setattr(continuous_mtp, "propose", real)
    for params in (dict(do_sample=True, temperature=0.8, seed=3), dict(repetition_penalty=1.3)):
        want = run(model, [(a, SamplingParams(max_new_tokens=12, **params))], lookup=None)[0][0].generated
        (seq,), _, _ = mtp_run(model, [(a, SamplingParams(max_new_tokens=12, **params))])
        assert seq.generated == want and seq.draft_tokens == 0


def test_a_prompt_from_the_prefix_cache_gets_its_greedy_tokens(model):
    """The second request shares the first's prompt and more: its row's first tokens come from the prefix cache
    (no hidden states there: the MTP layer starts after them), its tokens are still greedy's."""
    a = prompt(1, 40)
    b = a + prompt(3, 4)
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=1), num_speculative_tokens=2,
                              prefix_min_tokens=8)
    bad = keys_match_fed_tokens(engine)
    engine.start()
    try:
        first = engine.submit(a, SamplingParams(max_new_tokens=8))
        first.result(TIMEOUT_S)
        second = engine.submit(b, SamplingParams(max_new_tokens=NEW))
        second.result(TIMEOUT_S)
    finally:
        engine.stop()
    assert bad == [] and second.cached_tokens > 0 and second.draft_tokens > 0
    assert first.generated == greedy(model, a, 8) and second.generated == greedy(model, b)


def test_refusals_and_the_bytes_a_row_costs(path, model):
    cache = SlotKVCache.for_model(model, 64, max_rows=3)
    drafter = ContinuousEngine(model, cache, num_speculative_tokens=1).mtp
    assert drafter.nbytes == 3 * continuous_mtp.mtp_row_bytes(model, 64) > 0  # (what moeflow serve sizes rows by)
    with pytest.raises(ValueError, match="two ways to draft"):
        ContinuousEngine(model, cache, prompt_lookup=2, num_speculative_tokens=1)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        ContinuousEngine(model, cache, num_speculative_tokens=0)
    plain = MoEModel.from_pretrained(path)
    assert continuous_mtp.mtp_row_bytes(plain, 64) == 0
    with pytest.raises(ValueError, match=r"without multi-token-prediction layers.*num_nextn_predict_layers=1"):
        ContinuousEngine(plain, SlotKVCache.for_model(plain, 64, max_rows=1), num_speculative_tokens=1)
