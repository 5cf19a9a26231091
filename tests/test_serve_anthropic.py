"""Anthropic's Messages API (/v1/messages) on the tiny Qwen3-MoE that thinks and calls tools in Hermes markup
(tests/markup_helpers.py; greedy by its generation_config: this client version sends no temperature), driven by
Anthropic's own ``anthropic`` client: thinking, text and tool_use blocks are
the split of greedy generate's reply, streamed or not; a tool result goes back through the chat template."""

from __future__ import annotations

import anthropic
import pytest
from markup_helpers import WEATHER_TOOL, make_markup_checkpoint
from serve_helpers import Server

KEY = "sk-ant-local"
TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_markup_checkpoint(tmp_path_factory.mktemp("markup_anthropic"))
    srv = Server("--model", str(checkpoint), "--max-model-len", "400", "--api-key", KEY)
    yield srv
    srv.stop()


def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_reply_is_thinking_then_text(server):
    r = client(server).messages.create(model="claude-any", max_tokens=80,
                                       messages=[{"role": "user", "content": "Hello there!"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "User greets."), ("text", "Hello, friend!")]
    assert r.stop_reason == "end_turn" and r.model == "claude-any" and r.usage.output_tokens > 0


def test_a_tool_use_reply_streamed_or_not_and_its_result_sent_back(server):
    c = client(server)
    ask = dict(model="m", max_tokens=80, tools=[TOOL],
               messages=[{"role": "user", "content": "Weather in Paris?"}])
    r = c.messages.create(**ask)
    assert r.stop_reason == "tool_use"
    thinking, use = r.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Use the tool.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    with c.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == \
        [b.model_dump(exclude={"id", "signature"}) for b in r.content]
    assert final.stop_reason == "tool_use"
    turn2 = [*ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    counted = c.messages.count_tokens(model="m", tools=[TOOL], messages=turn2).input_tokens
    again = c.messages.create(**{**ask, "messages": turn2, "max_tokens": 3})
    assert again.usage.input_tokens == counted > r.usage.input_tokens


def test_forced_tool_and_errors(server):
    c = client(server)
    r = c.messages.create(model="m", max_tokens=80, tools=[TOOL],
                          tool_choice={"type": "tool", "name": "get_weather"},
                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert r.stop_reason == "tool_use" and r.content[-1].input == {"city": "Paris"}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
