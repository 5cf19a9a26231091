"""Guided decoding (moeflow/chat/guided.py): replies held to OpenAI's response_format JSON modes, in the engine
and behind the server, greedy and sampled, on the embedded byte-level model (which never learned JSON)."""

from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import MODEL_NAME, Server

from moeflow import MoEOffloadedMixtral
from moeflow.chat.guided import GuideFactory, response_format_grammar
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ContinuousEngine
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.sampling import SamplingParams

TIMEOUT_S = 120
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "word", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
PROMPT = list(b"The import statement combines two operations; it searches ")


def matches_schema(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"n", "word", "ok"} and type(obj["n"]) is int
            and isinstance(obj["word"], str) and len(obj["word"]) <= 6 and type(obj["ok"]) is bool)


@pytest.fixture(scope="module")
def model():
    return MoEOffloadedMixtral.from_pretrained(embedded_model_path())


@pytest.fixture(scope="module")
def engine(model):
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 256, max_rows=3)).start()
    yield engine
    engine.stop()


def run(model, engine, params: SamplingParams, grammar: str | None) -> tuple[str, str]:
    stops = tuple(model.generation_config.eos_ids())
    params = SamplingParams(**{**params.__dict__, "stop_token_ids": stops})
    guide = None
    if grammar is not None:
        guide = GuideFactory(model.tokenizer.path, model.config.vocab_size, list(stops)).guide(grammar, stops)
    seq = engine.submit(PROMPT, params, guide=guide)
    out = seq.result(TIMEOUT_S)
    return model.tokenizer.decode([t for t in out if t not in stops]), seq.finish_reason


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=80),
                                    SamplingParams(max_new_tokens=80, do_sample=True, temperature=1.0, seed=3),
                                    SamplingParams(max_new_tokens=80, do_sample=True, temperature=1.0, seed=11)])
def test_replies_follow_the_schema_and_end(model, engine, params):
    text, reason = run(model, engine, params, response_format_grammar(FORMAT))
    assert matches_schema(json.loads(text)), text
    assert reason == "stop"  # the grammar completed, then only the end-of-turn token was allowed


def test_the_premise_and_json_object(model, engine):
    """Unguided, this model does not write JSON (else the tests above prove nothing); json_object: any object."""
    text, _ = run(model, engine, SamplingParams(max_new_tokens=40), None)
    with pytest.raises(ValueError):
        json.loads(text)
    text, reason = run(model, engine, SamplingParams(max_new_tokens=40),
                       response_format_grammar({"type": "json_object"}))
    assert isinstance(json.loads(text), dict) and reason == "stop"
    assert response_format_grammar({"type": "text"}) is None


def test_a_guide_can_start_after_the_reasoning(model):
    stops = tuple(model.generation_config.eos_ids())
    factory = GuideFactory(model.tokenizer.path, model.config.vocab_size, list(stops))
    guide = factory.guide(response_format_grammar({"type": "json_object"}), stops, start_after=ord("|"))
    assert guide.allowed() is None  # free before the marker token
    guide.advance(ord("x"))
    assert guide.allowed() is None
    guide.advance(ord("|"))
    allowed = guide.allowed()
    assert allowed[ord("{")] and not allowed[ord("x")] and not allowed[stops[0]]


def test_the_server_answers_in_the_schema():
    srv = Server("--max-model-len", "256")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "A number?"}],
                                      response_format=FORMAT, temperature=0, max_tokens=80)
        assert matches_schema(json.loads(r.choices[0].message.content)) and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": {"type": "nope"}}})
        assert e.value.body["param"] == "response_format"
    finally:
        srv.stop()
