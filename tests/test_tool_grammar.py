"""Forced tool calls (tool_choice "required" / named) as grammars in each model's markup (moeflow/engine/
tool_grammar.py): the grammar accepts exactly the calls reply_formats parses, with allowed names and arguments that
follow the tool's schema."""

from __future__ import annotations

import json

import pytest

from moeflow.chat import reply_formats as rf
from moeflow.chat.guided import GrammarError, lark_grammar
from moeflow.chat.tool_grammar import FORCEABLE, tool_call_grammar
from moeflow.cli import embedded_model_path

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}
ARGS = '{"city": "Paris", "days": 2}'
CALLS = {  # format -> a forced reply calling get_weather(ARGS), as the grammar lays it out
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>",
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGS + "}]",
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                + ARGS + "<|tool_call_end|><|tool_calls_section_end|>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + ARGS
                    + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}


@pytest.fixture(scope="module")
def tokenizer():
    import llguidance

    text = (embedded_model_path() / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, eos_token=3)  # byte-level: every tag is written as text


def accepts(tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ids = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def grammar(fmt: str, choice, fenced: bool = False) -> str:
    return lark_grammar(tool_call_grammar(rf.TOOL_FORMATS[fmt], [WEATHER, TIME], choice, json.dumps, fenced), fmt)


@pytest.mark.parametrize("fmt", FORCEABLE)
def test_the_grammar_accepts_the_calls_the_parser_reads(tokenizer, fmt):
    text = CALLS[fmt]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert accepts(tokenizer, grammar(fmt, choice), text), (fmt, choice)
    reply = rf.split_text(text, rf.TOOL_FORMATS[fmt], rf.tool_schemas([WEATHER]), False, False)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", json.loads(ARGS))]
    named_other = grammar(fmt, {"type": "function", "function": {"name": "get_time"}})
    assert not accepts(tokenizer, named_other, text)  # only the named tool
    bad_args = text.replace('"days": 2', '"days": "two"')
    assert not accepts(tokenizer, grammar(fmt, "required"), bad_args)  # arguments follow the schema
    assert not accepts(tokenizer, grammar(fmt, "required"), "Sure! " + text)  # nothing but calls


def test_deepseek_v3_fenced_form_and_several_calls(tokenizer):
    fenced = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + ARGS
              + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert accepts(tokenizer, grammar("deepseek_v3", "required", fenced=True), fenced)
    assert rf.split_text(fenced, rf.TOOL_FORMATS["deepseek_v3"], {}, False, False).tool_calls[0].name == "get_weather"
    two = CALLS["hermes"] + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert accepts(tokenizer, grammar("hermes", "required"), two)


def test_refusals_name_the_problem():
    with pytest.raises(GrammarError, match="qwen3_coder tool-call markup is not supported"):
        tool_call_grammar(rf.TOOL_FORMATS["qwen3_coder"], [WEATHER], "required", json.dumps)
    with pytest.raises(GrammarError, match="'get_news', which is not among the request's tools"):
        tool_call_grammar(rf.TOOL_FORMATS["hermes"], [WEATHER], {"type": "function", "function": {"name": "get_news"}},
                          json.dumps)


@pytest.mark.parametrize("fmt", FORCEABLE)
def test_one_call_unless_parallel_calls_are_allowed(tokenizer, fmt):
    """A named function, or "required" with parallel_tool_calls false: exactly one call (then only the end of the
    turn); "required" with parallel calls: several."""
    two = {  # two get_weather calls in each markup
        "hermes": CALLS["hermes"] + "\n" + CALLS["hermes"],
        "mistral": CALLS["mistral"].replace("}]", "}, " + CALLS["mistral"].removeprefix("[TOOL_CALLS] [")),
        "kimi_k2": CALLS["kimi_k2"].replace("<|tool_calls_section_end|>", "") + CALLS["kimi_k2"].replace(
            "<|tool_calls_section_begin|>", "").replace(":0", ":1"),
        "deepseek_v3": CALLS["deepseek_v3"].replace("<｜tool▁calls▁end｜>", "")
        + CALLS["deepseek_v3"].replace("<｜tool▁calls▁begin｜>", ""),
    }[fmt]
    assert len(rf.split_text(two, rf.TOOL_FORMATS[fmt], rf.tool_schemas([WEATHER]), False, False).tool_calls) == 2

    def lark(choice, parallel):
        return lark_grammar(tool_call_grammar(rf.TOOL_FORMATS[fmt], [WEATHER, TIME], choice, json.dumps,
                                              parallel=parallel), fmt)

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert accepts(tokenizer, lark("required", True), two)
    for choice, parallel in (("required", False), (named, True), (named, False)):
        assert accepts(tokenizer, lark(choice, parallel), CALLS[fmt])
        assert not accepts(tokenizer, lark(choice, parallel), two), (choice, parallel)


def test_arguments_hold_to_the_declared_properties_unless_the_schema_allows_more(tokenizer):
    """JSON Schema admits undeclared keys by default: held to that, a small model writes made-up keys until its
    token limit. A forced call's arguments are the declared ones, unless the schema says additionalProperties."""
    open_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    extra = CALLS["hermes"].replace(ARGS, '{"city": "Paris", "x": 1}')
    plain = CALLS["hermes"].replace(ARGS, '{"city": "Paris"}')

    def lark(tool):
        return lark_grammar(tool_call_grammar(rf.TOOL_FORMATS["hermes"], [tool], "required", json.dumps), "hermes")

    assert accepts(tokenizer, lark(open_tool), plain) and not accepts(tokenizer, lark(open_tool), extra)
    allowed = json.loads(json.dumps(open_tool))
    allowed["function"]["parameters"]["additionalProperties"] = True
    assert accepts(tokenizer, lark(allowed), extra)
