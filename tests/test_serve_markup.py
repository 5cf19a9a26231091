"""`moeflow serve` on a tiny Qwen3-MoE that thinks in ``<think>`` and calls tools in Hermes markup, driven by the
official openai client: ``reasoning_content``, ``content`` and ``tool_calls`` are the split of single-request
greedy ``generate``'s reply, streamed or not (tests/markup_helpers.py trains the model)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from markup_helpers import GREETING, GREETING_REPLY, WEATHER, WEATHER_REPLY, WEATHER_TOOL, make_markup_checkpoint
from serve_helpers import Server

from moeflow import MoEModel
from moeflow.chat.template import ChatTemplate, stop_token_ids
from moeflow.serve.text import ChatReplies, MarkupAssembler, TextAssembler

NAME = "tiny-qwen3-tools"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_markup_checkpoint(tmp_path_factory.mktemp("markup_qwen3"))


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = Server("--model", str(checkpoint), "--served-model-name", NAME, "--max-model-len", "400",
                 "--prefill-chunk", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(checkpoint):
    return MoEModel.from_pretrained(checkpoint)


def greedy_text(model, messages, tools=None) -> tuple[str, int, int]:
    """(the reply's text with its tags, prompt tokens, reply tokens) of greedy generate, as the server runs it."""
    tok = model.tokenizer
    stops = list(stop_token_ids(ChatTemplate.from_directory(model.tokenizer.path.parent),
                                model.generation_config.eos_ids(), tok.encode))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    out = model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False,
                         eos_token_id=stops)[0, len(ids):].tolist()
    return tok.decode(out[:-1], skip_special_tokens=False), len(ids), len(out)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_the_reference_writes_the_markup(model):
    """The fixture's premise (else the server tests are vacuous)."""
    text, _, _ = greedy_text(model, WEATHER, [WEATHER_TOOL])
    assert text == WEATHER_REPLY.removesuffix("<|im_end|>")
    assert greedy_text(model, GREETING)[0] == GREETING_REPLY.removesuffix("<|im_end|>")


def test_chat_splits_reasoning_from_the_answer(server, model):
    _, n_prompt, n_out = greedy_text(model, GREETING)
    r = client(server).chat.completions.create(model=NAME, messages=GREETING, temperature=0, max_tokens=80)
    msg = r.choices[0].message
    assert (msg.content, msg.reasoning_content) == ("Hello, friend!", "User greets.")
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)


def test_a_tool_call_reply(server):
    r = client(server).chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], temperature=0,
                                               max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Use the tool."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and call.type == "function"


def test_streamed_tool_call_adds_up_to_the_same_reply(server):
    stream = client(server).chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL],
                                                    temperature=0, max_tokens=80, stream=True)
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("Use the tool.", "", "tool_calls")
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]


def test_tool_choice_none_leaves_the_call_as_text_and_an_unknown_one_is_refused(server):
    c = client(server)
    r = c.chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], tool_choice="none",
                                  temperature=0, max_tokens=80)
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert msg.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], tool_choice="always")
    assert e.value.body["param"] == "tool_choice"


def test_the_call_sent_back_renders_and_the_parsers_can_be_turned_off(server, model):
    """A second turn with the call and its result goes through the template (arguments as a dict); and with
    both parsers off the reply is plain text."""
    r = client(server).chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], temperature=0,
                                               max_tokens=80)
    call = r.choices[0].message.tool_calls[0]
    turn2 = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client(server).chat.completions.create(model=NAME, messages=turn2, tools=[WEATHER_TOOL], temperature=0,
                                                max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    template_text = ChatTemplate.from_directory(model.tokenizer.path.parent).templates["default"]
    replies = ChatReplies(model.tokenizer, template_text, "none", "none")
    assert type(replies.assembler([], set(), "<think>\n", [WEATHER_TOOL], None)) is TextAssembler
    auto = ChatReplies(model.tokenizer, template_text).assembler([], set(), "<think>\n", [WEATHER_TOOL], "auto")
    assert isinstance(auto, MarkupAssembler) and auto.tool.name == "hermes" and auto.in_reasoning


def test_json_mode_keeps_the_reasoning_and_answers_in_json(server):
    """The prompt opens <think>: the reply reasons freely, then the grammar holds the answer to the schema (a
    short string, which this tiny model, left alone in a string, would never close)."""
    schema = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 8}}, "required": ["reply"],
              "additionalProperties": False}
    r = client(server).chat.completions.create(
        model=NAME, messages=GREETING, temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    msg = r.choices[0].message
    assert msg.reasoning_content == "User greets."  # as unguided: the learned reasoning, untouched
    answer = json.loads(msg.content)
    assert list(answer) == ["reply"] and len(answer["reply"]) <= 8 and r.choices[0].finish_reason == "stop"


def test_chat_cli_streams_thinking_then_the_answer(model):
    """`moeflow chat` / `generate --chat` split the reply as the server does: the reasoning marked, then the answer."""
    import io

    from moeflow.cli.serve import ReplyStreamer, reply_assembler

    tok = model.tokenizer
    stops = tuple(stop_token_ids(ChatTemplate.from_directory(tok.path.parent), model.generation_config.eos_ids(),
                                 tok.encode))
    prompt = tok.apply_chat_template(GREETING, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    split, out = reply_assembler(tok, stops, prompt), io.StringIO()
    model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False, eos_token_id=list(stops),
                   streamer=ReplyStreamer(split.reply, stream=out))
    assert out.getvalue() == "(thinking) User greets.\nHello, friend!\n"


def test_forced_tool_calls_in_the_models_markup(server):
    """tool_choice named: the call the model writes anyway (the grammar's layout is its own); "required" where the
    model, left alone, writes no valid call (the tag is a special token in this vocabulary): a valid call after
    the same free reasoning."""
    c = client(server)
    named = c.chat.completions.create(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], temperature=0,
                                      max_tokens=80, tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    closed = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
    ask = dict(model=NAME, messages=GREETING, tools=[closed], temperature=0, max_tokens=80)
    free = c.chat.completions.create(**ask).choices[0]
    assert not free.message.tool_calls  # the premise: unforced, no call parses
    r = c.chat.completions.create(**ask, tool_choice="required").choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert getattr(r.message, "reasoning_content", None) == getattr(free.message, "reasoning_content", None)
    assert [(t.function.name, json.loads(t.function.arguments)["city"] in ("Paris", "Rome"))
            for t in r.message.tool_calls] == [("get_weather", True)] * len(r.message.tool_calls)
