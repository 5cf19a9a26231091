"""Prompt lookup decoding (``generate(prompt_lookup_num_tokens=...)``, moeflow.engine.lookup): drafts are found as
transformers finds them, and verifying them in one pass gives exactly plain greedy decoding's tokens, resident and
under every offload policy, with drafts really accepted (else the equality would prove nothing)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine.lookup import find_draft
from moeflow.offload.policies import POLICY_NAMES

NEW_TOKENS = 40
PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
           "The sequence of the string is the")


@pytest.mark.parametrize("ngram", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 4, 10])
def test_drafts_are_transformers_prompt_lookup_candidates(ngram, num_tokens):
    gen = torch.Generator().manual_seed(ngram * 10 + num_tokens)
    hf = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=ngram, max_length=10**6)
    found = 0
    for _ in range(200):
        seq = torch.randint(0, 5, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen)
        want, _ = hf.get_candidates(seq[None])
        want = want[0, seq.numel():].tolist()
        assert find_draft(seq, num_tokens, ngram) == want, seq.tolist()
        found += bool(want)
    assert found > 50  # most random sequences over 5 ids have a match


@pytest.fixture(scope="module")
def reference():
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path())
    tok = model.tokenizer
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        out[prompt] = ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return model, out


@pytest.mark.parametrize("num_tokens", [1, 3, 10])
def test_lookup_gives_the_greedy_tokens_and_accepts_drafts(reference, num_tokens):
    model, out = reference
    for ids, want in out.values():
        model.stats.reset()
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=num_tokens)
        assert torch.equal(got, want)
        s = model.stats
        assert 0 < s.accepted_tokens <= s.draft_tokens  # the embedded model repeats itself: drafts are kept
        assert s.decode.steps == NEW_TOKENS - 1 - s.accepted_tokens  # each pass: its accepted drafts + one token
        assert "accepted" in s.summary()


def test_a_left_padded_prompt_and_the_repetition_penalty(reference):
    """Left padding is neither matched for drafts nor penalised: the padding is a token that, were it real, would
    change the penalised greedy reply (found below, so the comparison can fail)."""
    model, out = reference
    ids, _ = out[PROMPTS[1]]
    mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones_like(ids)], 1)
    penalised = model.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=3.0)
    def reply_if_real(f: int) -> torch.Tensor:  # the penalised reply with one token f as the prompt's first
        return model.generate(torch.cat([torch.tensor([[f]]), ids], 1), max_new_tokens=24, do_sample=False,
                              repetition_penalty=3.0)[:, 1:]

    t = ids.shape[1]  # fillers that would change the first token (the prefill's) and a later one (a draft pass's)
    candidates = sorted(set(penalised[0, t:].tolist()) - set(ids[0].tolist()))
    replies = {f: reply_if_real(f) for f in candidates}
    first = next(f for f, r in replies.items() if r[0, t] != penalised[0, t])
    later = next(f for f, r in replies.items() if r[0, t] == penalised[0, t] and not torch.equal(r, penalised))
    for filler, penalty in ((first, 1.0), (first, 3.0), (later, 3.0)):
        padded = torch.cat([torch.full((1, 3), filler, dtype=torch.long), ids], 1)
        model.stats.reset()
        want = model.generate(padded, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              repetition_penalty=penalty)
        got = model.generate(padded, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             repetition_penalty=penalty, prompt_lookup_num_tokens=6)
        assert torch.equal(got, want), penalty
        assert model.stats.draft_tokens > 0


def test_eos_and_the_token_limit_end_it_as_plain_decoding(reference):
    model, out = reference
    ids, want = out[PROMPTS[0]]
    stop = int(want[0, ids.shape[1] + 9])  # a token that the greedy reply produces, as the end-of-sequence id
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stop)
    got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stop,
                         prompt_lookup_num_tokens=10)
    assert torch.equal(got, plain) and int(got[0, -1]) == stop and got.shape[1] <= ids.shape[1] + 10
    for limit in (1, 2, 7):
        got = model.generate(ids, max_new_tokens=limit, do_sample=False, prompt_lookup_num_tokens=10)
        assert torch.equal(got, want[:, : ids.shape[1] + limit])


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "resident"])
def test_every_policy_keeps_the_resident_tokens(reference, policy, transport):
    _, out = reference
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), offload=OffloadConfig(
        policy=policy, gpu_expert_slots=6, transport=transport, random_delay_ms=0.3, seed=1))
    try:
        for ids, want in out.values():
            got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=5)
            assert torch.equal(got, want), f"{policy}/{transport}"
        assert model.stats.accepted_tokens > 0
    finally:
        model.experts.close()


def test_what_it_does_not_cover_is_refused_by_name(reference):
    model, out = reference
    ids, _ = out[PROMPTS[1]]
    cases = [(dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be a positive integer"),
             (dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=0), "max_matching_ngram_size"),
             (dict(prompt_lookup_num_tokens=4, do_sample=True), "do_sample=False"),
             (dict(prompt_lookup_num_tokens=4, do_sample=False, micro_batch_size=1), "micro_batch_size")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="batch of one sequence"):
        model.generate(ids.repeat(2, 1), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=4)
