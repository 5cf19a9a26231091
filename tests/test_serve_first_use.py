"""`moeflow serve` as a newcomer first meets it (issue 35), driven by the official openai and anthropic clients:
the start-up line docs/serving.md shows, forced tool calls on the default server (the embedded model, whose chat
template shows no tool-call markup) and with ``--tool-call-parser hermes`` (the markup forced by the grammar:
one call ends the reply, ``parallel_tool_calls`` honoured), and /v1/messages without ``max_tokens``."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, ROOT, Server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
# a call this model writes is ~80 tokens of its byte-level vocabulary (the embedded model's greedy reply)
TWO_CALLS_TOKENS = 240


@pytest.fixture(scope="module")
def default_server():
    srv = Server()  # no flags but the port and the device: what `moeflow serve` runs
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hermes_server():
    srv = Server("--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def openai_client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def anthropic_client(srv: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)


def test_the_start_up_line_is_the_one_docs_serving_md_shows(default_server):
    printed = next(line.strip() for line in default_server.output if "/v1 |" in line)
    shown = re.search(r"`(moeflow serve: model .*?)`", (ROOT / "docs" / "serving.md").read_text()).group(1)
    assert re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:8000", printed) == shown


def test_without_a_known_markup_a_forced_call_is_refused_in_the_client_s_terms(default_server):
    """The embedded model's template writes no tool-call markup (auto finds none): 400 naming tool_choice as the
    client sent it; Anthropic's message quotes Anthropic's form, never OpenAI's."""
    c = openai_client(default_server)
    for choice, quoted in ((NAMED, json.dumps(NAMED)), ("required", '"required"')):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                      max_tokens=8)
        assert e.value.body["param"] == "tool_choice"
        assert f"tool_choice {quoted} forces a tool call" in e.value.body["message"]
        assert "no tool-call markup" in e.value.body["message"]
    a = anthropic_client(default_server)
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="m", max_tokens=8, tools=[ANTHROPIC_TOOL], tool_choice=choice, messages=ASK)
        message = e.value.body["error"]["message"]
        assert f"tool_choice {json.dumps(choice)} forces a tool call" in message
        assert "function" not in message and "required" not in message  # no OpenAI form the client never sent


def test_messages_without_max_tokens_say_the_api_requires_it(default_server):
    a = anthropic_client(default_server)
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK will not leave it out: its raw request does
        a.post("/v1/messages", body={"model": "m", "messages": ASK}, cast_to=httpx.Response)
    message = e.value.body["error"]["message"]
    assert "Messages API requires max_tokens" in message and "4096" not in message
    assert a.messages.count_tokens(model="m", messages=ASK).input_tokens > 0  # count_tokens takes no max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_single_call_ends_the_reply(hermes_server, stream):
    """A named function, or "required" with parallel_tool_calls false: one call, then the end of the turn
    (finish "tool_calls", no markup in content), well before max_tokens (the model alone writes no end)."""
    c = openai_client(hermes_server)
    for extra in (dict(tool_choice=NAMED), dict(tool_choice="required", parallel_tool_calls=False)):
        ask = dict(model=MODEL_NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=TWO_CALLS_TOKENS,
                   **extra)
        if stream:
            content, calls, finish = "", [], None
            for chunk in c.chat.completions.create(stream=True, **ask):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                calls += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        else:
            r = c.chat.completions.create(**ask)
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, \
                r.choices[0].finish_reason
            assert r.usage.completion_tokens < TWO_CALLS_TOKENS
        assert (finish, content or None) == ("tool_calls", None), extra
        [call] = calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_parallel_calls_are_allowed_unless_turned_off(hermes_server):
    """"required" with parallel_tool_calls (OpenAI's default): this model writes a second call; the token limit
    cuts a third, which is dropped (a forced reply has no content), not left as markup."""
    c = openai_client(hermes_server)
    r = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], temperature=0,
                                  max_tokens=TWO_CALLS_TOKENS, tool_choice="required").choices[0]
    assert len(r.message.tool_calls) >= 2 and r.message.content is None
    assert {t.function.name for t in r.message.tool_calls} == {"get_weather"}


def test_anthropic_forced_tool_use_ends_the_turn(hermes_server):
    """tool_choice "tool", or "any" with disable_parallel_tool_use: one tool_use block, stop_reason tool_use
    (greedy: temperature 0; the embedded model samples by default); "any" alone allows several."""
    a = anthropic_client(hermes_server)
    ask = dict(model="m", max_tokens=TWO_CALLS_TOKENS, tools=[ANTHROPIC_TOOL], messages=ASK,
               extra_body={"temperature": 0})  # this client version has no temperature argument
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        r = a.messages.create(tool_choice=choice, **ask)
        assert r.stop_reason == "tool_use" and r.usage.output_tokens < TWO_CALLS_TOKENS, choice
        [use] = r.content
        assert (use.type, use.name, set(use.input)) == ("tool_use", "get_weather", {"city"})
    r = a.messages.create(tool_choice={"type": "any"}, **ask)
    assert [b.type for b in r.content][:2] == ["tool_use", "tool_use"]
