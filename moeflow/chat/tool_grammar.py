"""Forced tool calls (OpenAI's ``tool_choice`` "required" or a named function) as a grammar in the model's own
tool-call markup, for guided decoding (:mod:`moeflow.chat.guided`).

The reply is held to calls written exactly as :mod:`moeflow.chat.reply_formats` parses them, each call's
name one of the allowed tools and its arguments JSON that follows the tool's parameter schema (laid out as
``json.dumps`` writes it; no keys beyond the declared properties unless the schema allows them explicitly).
Markups whose arguments are JSON are supported: ``hermes``, ``mistral``, ``kimi_k2`` and ``deepseek_v3``
(V3.1's ``NAME<｜tool▁sep｜>{...}``, or V3's fenced form when the template
writes it); the XML-like markups (``qwen3_coder``, ``glm45``, ``minimax_m2``) write values as text and are
refused by name.
A tag the vocabulary holds as a special token is written as that token (``<[id]>``); others as text.

How many calls: one for a named function, or for "required" when the client turned ``parallel_tool_calls`` off
(Anthropic: ``disable_parallel_tool_use``); one or more for "required" otherwise. A grammar that is complete
allows nothing but the end-of-turn tokens (:class:`~moeflow.chat.guided.Guide`), so a single call ends the reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from moeflow.chat.guided import JSON_LAYOUT, GrammarError
from moeflow.chat.reply_formats import ToolFormat

FORCEABLE = ("hermes", "mistral", "kimi_k2", "deepseek_v3")


def _functions(tools: list[dict], tool_choice: str | dict) -> list[tuple[str, dict]]:
    """(name, parameters schema) of the tools a call may use: every tool ("required") or the named one."""
    available = []
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            available.append((fn["name"], _closed(fn.get("parameters") or {"type": "object"})))
    if tool_choice == "required":
        return available
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = [(n, p) for n, p in available if n == name]
    if not chosen:
        raise GrammarError(f"tool_choice names {name!r}, which is not among the request's tools "
                           f"({', '.join(n for n, _ in available) or 'none'})")
    return chosen


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and does not say
    otherwise: a call's arguments are the tool's declared parameters. (JSON Schema's default admits any other key;
    held to it, a small model writes made-up keys until its token limit and never closes the call.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("items", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    return out


def _json(schema: dict) -> str:
    """An inline JSON rule of llguidance's lark: ``%json {schema}``, laid out as json.dumps writes it."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _text(s: str) -> str:
    return json.dumps(s)  # a lark string literal


def single_call(tool_choice: str | dict, parallel: bool) -> bool:
    """Whether a forced reply is exactly one call: a named function, or "required" without parallel calls."""
    return tool_choice != "required" or not parallel


def tool_call_grammar(fmt: ToolFormat, tools: list[dict], tool_choice: str | dict, tag: Callable[[str], str],
                      fenced: bool = False, parallel: bool = True) -> str:
    """The lark grammar of a reply made of tool calls. ``tag(text)``: how a markup tag is written (a special
    token's ``<[id]>``, or a string literal); ``fenced``: DeepSeek-V3's ``function<sep>NAME`` + fenced JSON;
    ``parallel``: "required" may write several calls (:func:`single_call`)."""
    if fmt.name not in FORCEABLE:
        raise GrammarError(f"a forced tool call (tool_choice) in the {fmt.name} tool-call markup is not supported "
                           f"(its values are text, not JSON): let the model choose (forceable markups: "
                           f"{', '.join(FORCEABLE)})")
    functions = _functions(tools, tool_choice)
    if not functions:
        raise GrammarError("a forced tool call (tool_choice) needs at least one named tool in 'tools'")
    one = single_call(tool_choice, parallel)
    rules: list[str] = []
    if fmt.name in ("hermes", "mistral"):  # the name and the arguments inside one JSON object
        objects = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                    "required": ["name", "arguments"], "additionalProperties": False} for n, p in functions]
        call: dict[str, Any] = objects[0] if len(objects) == 1 else {"anyOf": objects}
        if fmt.name == "hermes":
            rules.append("start: call" if one else f"start: call ({_text(chr(10))} call)*")
            rules.append(f"call: {tag('<tool_call>')} {_text(chr(10))} {_json(call)} {_text(chr(10))} "
                         f"{tag('</tool_call>')}")
        else:
            array = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one else {})}
            rules.append(f"start: {tag('[TOOL_CALLS]')} {_text(' ')} {_json(array)}")
        return "\n".join(rules)
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    for i, (name, params) in enumerate(functions):
        if fmt.name == "kimi_k2":
            body = (f"{tag('<|tool_call_begin|>')} {_text(f'functions.{name}:')} /[0-9]+/ "
                    f"{tag('<|tool_call_argument_begin|>')} {_json(params)} {tag('<|tool_call_end|>')}")
        elif fenced:
            body = (f"{tag('<｜tool▁call▁begin｜>')} {_text('function')} {tag('<｜tool▁sep｜>')} "
                    f"{_text(name + chr(10) + '```json' + chr(10))} {_json(params)} {_text(chr(10) + '```')} "
                    f"{tag('<｜tool▁call▁end｜>')}")
        else:
            body = (f"{tag('<｜tool▁call▁begin｜>')} {_text(name)} {tag('<｜tool▁sep｜>')} {_json(params)} "
                    f"{tag('<｜tool▁call▁end｜>')}")
        rules.append(f"call_{i}: {body}")
    begin, end = ((tag("<|tool_calls_section_begin|>"), tag("<|tool_calls_section_end|>")) if fmt.name == "kimi_k2"
                  else (tag("<｜tool▁calls▁begin｜>"), tag("<｜tool▁calls▁end｜>")))
    return "\n".join([f"start: {begin} ({alternatives}){'' if one else '+'} {end}", *rules])


def tag_writer(tokenizer) -> Callable[[str], str]:
    """``tag`` for :func:`tool_call_grammar`: a tag the tokenizer holds as one special token -> ``<[id]>``."""
    special = tokenizer.special_token_ids()

    def tag(text: str) -> str:
        token = tokenizer.token_id(text)
        return f"<[{token}]>" if token is not None and token in special else _text(text)

    return tag
