"""Chat replies' text markup split into content, reasoning and tool calls (moeflow/chat/reply_formats.py), and the
streaming contract: a delta is never taken back, and the deltas add up to the whole reply's split."""

from __future__ import annotations

import json

import pytest

from moeflow.chat import reply_formats as rf
from moeflow.serve.protocol import ChatCompletionRequest, ChatMessage, Unsupported

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "zip": {"type": "string"}}}}}]
SCHEMAS = rf.tool_schemas(TOOLS)
WANT = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12], "zip": "75001"}

REPLIES = {  # format -> a reply calling get_weather(WANT) after some content
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WANT) + "}\n</tool_call>",
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                    "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n"
                    "</tool_call>"),
    "glm45": ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true"
              "</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[9, 12]</arg_value>\n<arg_key>zip</arg_key>\n"
              "<arg_value>75001</arg_value>\n</tool_call>"),
    "minimax_m2": ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n<parameter name="days">3</parameter>\n<parameter name="metric">true</parameter>\n'
                   '<parameter name="hours">[9, 12]</parameter>\n<parameter name="zip">75001</parameter>\n'
                   "</invoke>\n</minimax:tool_call>"),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    + json.dumps(WANT) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_v32": ("Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="hours" string="false">[9, 12]</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="zip" string="true">75001</｜DSML｜parameter>\n'
                     "</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    "kimi_k2": ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                "<|tool_call_argument_begin|>" + json.dumps(WANT) + "<|tool_call_end|><|tool_calls_section_end|>"),
    "mistral": 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WANT) + "}]",
}


def split(text, fmt, reasoning=False, in_reasoning=False, final=True):
    return rf.split_text(text, rf.TOOL_FORMATS[fmt] if fmt else None, SCHEMAS, reasoning, in_reasoning, final)


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_each_markup_gives_the_call_with_typed_arguments(fmt):
    reply = split(REPLIES[fmt], fmt)
    assert reply.content == "Checking."
    assert [c.name for c in reply.tool_calls] == ["get_weather"]
    assert json.loads(reply.tool_calls[0].arguments) == WANT  # text values typed by the schema; "75001" stays text


def test_deepseek_v31_and_mistral_v11_variants_and_several_calls():
    v31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Rome\"}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert [json.loads(c.arguments)["city"] for c in split(v31, "deepseek_v3").tool_calls] == ["Rome", "Oslo"]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert [json.loads(c.arguments)["city"] for c in split(v11, "mistral").tool_calls] == ["Rome", "Oslo"]
    two = REPLIES["hermes"] + "\n" + REPLIES["hermes"].removeprefix("Checking.\n")
    reply = split(two, "hermes")
    assert (reply.content, len(reply.tool_calls)) == ("Checking.", 2)


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
                                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
def test_a_malformed_or_cut_call_stays_content(text):
    reply = split("Hi " + text, "hermes")
    assert (reply.content, reply.tool_calls) == ("Hi " + text, [])


def test_reasoning_split_opened_by_the_reply_or_by_the_prompt():
    reply = split("<think>\nUser greets.\n</think>\n\nHello!", None, reasoning=True)
    assert (reply.reasoning, reply.content) == ("User greets.", "Hello!")
    reply = split("User greets.\n</think>\n\nHello!", None, reasoning=True, in_reasoning=True)
    assert (reply.reasoning, reply.content) == ("User greets.", "Hello!")
    assert split("Hello!", None, reasoning=True).content == "Hello!"  # no <think>: all content
    cut = split("Still thinking", None, reasoning=True, in_reasoning=True)  # never closed (token limit)
    assert (cut.reasoning, cut.content) == ("Still thinking", "")
    # a call written inside the reasoning is not a call
    inner = split("<think>maybe <tool_call>{}</tool_call></think>Done", "hermes", reasoning=True)
    assert (inner.content, inner.tool_calls, inner.reasoning) == ("Done", [], "maybe <tool_call>{}</tool_call>")
    assert rf.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not rf.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def stream(text: str, fmt, reasoning: bool, in_reasoning: bool) -> tuple[str, str, list]:
    """Every character prefix as a streaming step (what SplitAssembler sends), then the final split: the
    reasoning and content deltas, and the calls. Text sent that later became a tag would show as a take-back,
    or as deltas that no longer add up to the final split."""
    sent = {"reasoning": "", "content": ""}
    for end in range(len(text) + 1):
        final = end == len(text)
        reply = split(text[:end], fmt, reasoning, in_reasoning, final)
        for key in sent:
            now = getattr(reply, key)
            if not final:
                assert now.startswith(sent[key]), f"{key} taken back at {end}: {sent[key]!r} -> {now!r}"
            if now.startswith(sent[key]):
                sent[key] = now
        if not final:
            assert reply.tool_calls == []  # calls come whole at the end
    return sent["reasoning"], sent["content"], reply.tool_calls


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_streaming_never_takes_text_back_and_adds_up(fmt):
    text = "Think about <b>.\n</think>\n\n" + REPLIES[fmt]
    reasoning, content, calls = stream(text, fmt, reasoning=True, in_reasoning=True)
    whole = split(text, fmt, reasoning=True, in_reasoning=True)
    assert (reasoning, content, calls) == (whole.reasoning, whole.content, whole.tool_calls)
    assert (reasoning, content, [c.name for c in calls]) == ("Think about <b>.", "Checking.", ["get_weather"])


def test_streaming_plain_text_with_angle_brackets_is_all_sent():
    text = "a < b and <tool and <thin are text"
    reasoning, content, calls = stream(text, "hermes", reasoning=True, in_reasoning=False)
    assert (reasoning, content, calls) == ("", text, [])


def test_the_template_names_the_markup():
    assert rf.detect_tool_format("{{ '<tool_call>\\n<function=' }}").name == "qwen3_coder"
    assert rf.detect_tool_format("<tool_call>{{ name }}<arg_key>").name == "glm45"
    assert rf.detect_tool_format('<tool_call>\\n{"name": ...}').name == "hermes"
    assert rf.detect_tool_format("<minimax:tool_call><tool_call>").name == "minimax_m2"
    assert rf.detect_tool_format("<｜tool▁calls▁begin｜>").name == "deepseek_v3"
    assert rf.detect_tool_format("{{ '<｜DSML｜function_calls>' }}").name == "deepseek_v32"
    assert rf.detect_tool_format("[TOOL_CALLS]").name == "mistral"
    assert rf.detect_tool_format("{{ messages }}") is None
    assert rf.tool_format("none", "<tool_call>") is None
    with pytest.raises(ValueError, match="known: auto, none, minimax_m2"):
        rf.tool_format("hermes2", "")
    assert rf.reasoning_wanted("auto", "", has_think_tokens=True) and not rf.reasoning_wanted("auto", "", False)
    assert not rf.reasoning_wanted("none", "<think>", True)


def test_tool_choice_and_arguments_sent_back():
    for choice in ("always", "required"):  # unknown; forced with no tools to call
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice=choice)
        with pytest.raises(Unsupported) as e:
            req.check_supported()
        assert e.value.param == "tool_choice"
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="auto").check_supported()
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}):
        with pytest.raises(Unsupported) as e:
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                  response_format=bad).grammar()
        assert e.value.param == "response_format"
    back = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}])
    calls = back.as_template_input()["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1}  # templates iterate the arguments
    assert calls[1]["function"]["arguments"] == "not json"
