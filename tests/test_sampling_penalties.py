"""Repetition penalty, min-p, OpenAI's presence / frequency penalties and logit bias: against transformers' own
processors, transformers' generate, and, in the continuous engine, a plain reference loop over full forwards."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model

from moeflow import MoEOffloadedMixtral
from moeflow.engine.continuous import ContinuousEngine
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.sampling import GenerationConfig, SamplingParams, adjust_logits, penalize_repetitions, warp_scores
from moeflow.serve.protocol import CompletionRequest, Unsupported

TIMEOUT_S = 120


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_is_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    seen = torch.randint(0, 50, (3, 20), generator=g)  # repeats included
    want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    assert torch.equal(penalize_repetitions(logits, seen, penalty), want)


@pytest.mark.parametrize("cfg", [dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
                                 dict(temperature=1.3, top_k=None, top_p=1.0, min_p=0.2)])
def test_warpers_are_transformers_in_their_order(cfg):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(1)) * 3
    want = TemperatureLogitsWarper(cfg["temperature"])(None, logits.clone())
    if cfg["top_k"]:
        want = TopKLogitsWarper(cfg["top_k"])(None, want)
    if cfg["top_p"] < 1:
        want = TopPLogitsWarper(cfg["top_p"])(None, want)
    want = MinPLogitsWarper(cfg["min_p"])(None, want)
    got = warp_scores(logits, GenerationConfig(do_sample=True, **cfg))
    assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got[~got.isinf()], want[~want.isinf()])
    assert got.isinf().any()  # the filters did filter


def test_openai_penalties_and_bias():
    logits = torch.zeros(1, 6)
    out = adjust_logits(logits, [5], [1, 1, 2], ((3, 2.5),), 1.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert out.tolist() == [[0.0, -1.0, -0.75, 2.5, 0.0, 0.0]]  # prompt token 5 untouched: reply-only penalties
    assert logits.abs().sum() == 0  # the caller's logits stay as they were


def transformers_spares_left_padding() -> bool:
    """Whether transformers' generate hands the repetition penalty each row's left-padding length (5.24: its
    processor takes them as a tensor) rather than penalizing the pad tokens too (5.17, the lent GPU machine's)."""
    import inspect

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    given = inspect.signature(RepetitionPenaltyLogitsProcessor).parameters.get("prompt_ignore_length")
    return given is not None and "Tensor" in str(given.annotation)


def test_generate_with_repetition_penalty_is_transformers(tmp_path):
    """Greedy and left-padded: transformers (5.24) penalizes the row's real tokens, not its left padding (the pad id
    0 is the next token of row 0 here once the penalty spares it); so does moeflow. An older transformers that
    penalizes the padding too is no oracle for this."""
    if not transformers_spares_left_padding():
        pytest.skip("this transformers' repetition penalty also penalizes left padding (moeflow follows 5.24's)")
    ref = make_tiny_model(seed=2)
    ref.save_pretrained(tmp_path)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, repetition_penalty=1.8,
                            eos_token_id=None, pad_token_id=0)
        plain = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert not torch.equal(want, plain)  # the penalty changes this model's tokens: the comparison means something
    got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, repetition_penalty=1.8,
                         eos_token_id=[])
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("penalties")
    make_tiny_model(seed=3).save_pretrained(path)
    return MoEOffloadedMixtral.from_pretrained(path)


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by full forwards over the whole sequence, the logits adjusted by hand."""
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = model(torch.tensor([prompt + out])).logits[:, -1].float()
        logits = adjust_logits(logits, prompt, out, params.logit_bias, params.repetition_penalty,
                               params.presence_penalty, params.frequency_penalty)
        out.append(int(logits.argmax()))
    return out


def test_engine_penalties_are_the_reference_loop(tiny):
    prompt = [5, 17, 5, 42, 9, 17]
    cases = [SamplingParams(max_new_tokens=16, repetition_penalty=1.6),
             SamplingParams(max_new_tokens=16, presence_penalty=1.5, frequency_penalty=0.7),
             SamplingParams(max_new_tokens=16, logit_bias=((7, 3.0), (11, -100.0)))]
    engine = ContinuousEngine(tiny, SlotKVCache.for_model(tiny, 64, max_rows=3), prefill_chunk=4).start()
    try:
        plain = engine.submit(prompt, SamplingParams(max_new_tokens=16)).result(TIMEOUT_S)
        got = [engine.submit(prompt, params).result(TIMEOUT_S) for params in cases]
    finally:
        engine.stop()
    for params, tokens in zip(cases, got, strict=True):
        assert tokens == reference(tiny, prompt, params), params
        assert tokens != plain, params  # each setting changes this model's tokens
    assert tokens.count(7) > plain.count(7)
    want = tiny.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.6,
                         eos_token_id=[])[0, len(prompt):].tolist()
    assert got[0] == want  # the engine and generate agree on HF's penalty


def test_logit_bias_is_checked_against_the_vocabulary():
    req = CompletionRequest(model="m", prompt="x", logit_bias={"5": 1.0, "90": -100})
    assert req.token_biases(97) == ((5, 1.0), (90, -100.0))
    for bad in ({"97": 1.0}, {"x": 1.0}, {"3": 101.0}):
        with pytest.raises(Unsupported) as e:
            CompletionRequest(model="m", prompt="x", logit_bias=bad).token_biases(97)
        assert e.value.param == "logit_bias"
