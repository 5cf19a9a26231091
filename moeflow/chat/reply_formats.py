"""Chat replies written as text markup, split into content, reasoning and tool calls (what OpenAI clients read).

Most open MoE models think between ``<think>`` and ``</think>`` and write tool calls in a markup of their own:

================  ==========================================================================================
``hermes``        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, ERNIE-4.5, ...)
``qwen3_coder``   ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` (Qwen3-Coder,
                  Qwen3-Next, Qwen3.5)
``glm45``         ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>`` (GLM-4.5 .. 4.7)
``minimax_m2``    ``<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...``
``deepseek_v3``   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>``, both V3's
                  ``function<｜tool▁sep｜>NAME`` + a fenced JSON and V3.1's ``NAME<｜tool▁sep｜>{json}``
``deepseek_v32``  ``<｜DSML｜function_calls><｜DSML｜invoke name="NAME">`` + ``parameter name=KEY string=true|false``
``kimi_k2``       ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}``
``mistral``       ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``
================  ==========================================================================================

(gpt-oss speaks harmony, split on token ids by :mod:`moeflow.chat.harmony`.) :func:`detect_tool_format` picks the
markup from the chat template's text, the way the template itself asks the model to write calls; a server flag
overrides it (vLLM's parser names). Values written as text (the XML-like markups) are typed by the tool's JSON
schema. A block that does not parse (malformed, or cut by the token limit) stays in the content: no generated
text is lost. :func:`split_text` also serves streaming: with ``final=False`` it holds back what may still become
markup, so a streamed delta never has to be taken back.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments``


@dataclass
class Reply:
    """A reply's text by destination: ``content``, ``reasoning`` (``reasoning_content``), ``tool_calls``."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


Tools = dict[str, dict[str, Any]]  # tool name -> its parameters' JSON schema ("properties")


def tool_schemas(tools: list[dict] | None) -> Tools:
    """OpenAI's ``tools`` as name -> properties schema (what typing a text value needs)."""
    out: Tools = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = dict((fn.get("parameters") or {}).get("properties") or {})
    return out


def _typed(value: str, schema: dict | None) -> Any:
    """A parameter written as text, typed by its schema: a string (or a key the schema does not name) stays text,
    anything else is read as JSON (or a Python literal: ``True``, ``None``), else kept as text."""
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} - {None}
    if not kinds or "string" in kinds:
        return value
    for parse in (json.loads, ast.literal_eval):
        try:
            parsed = parse(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if "integer" in kinds and isinstance(parsed, float) and parsed.is_integer():
            parsed = int(parsed)
        return parsed
    return value


def _strip_one_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _call(name: str, args: Any) -> ToolCall | None:
    name = name.strip()
    if not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return _call(obj["name"], args)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call markup: blocks from ``start`` to ``end`` (None: to the end of the reply), each parsed by
    ``parse(body, tools)`` into calls (None: the block is malformed and stays content)."""

    name: str
    start: str
    end: str | None
    parse: Callable[[str, Tools], list[ToolCall] | None]
    marker: str  # what in a chat template shows that the model writes this markup
    markup: tuple[str, ...] = ()  # every tag it writes (kept in the text when the tokenizer marks them special)

    def tags(self) -> tuple[str, ...]:
        return (self.start, *((self.end,) if self.end else ()), *self.markup)


def _hermes(body: str, tools: Tools) -> list[ToolCall] | None:
    call = _json_call(_loads(body.strip()))
    return [call] if call else None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _all_or_none(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """The calls of a block, or None (the block stays content) when it has none or one did not parse."""
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _xml_calls(body: str, tools: Tools, invoke: re.Pattern, parameter: re.Pattern,
               strip_keys: bool) -> list[ToolCall] | None:
    """Calls written as (name, inner) ``invoke`` matches whose ``parameter`` matches are (key, text value); a value
    loses one leading and trailing newline and is typed by the tool's schema."""
    calls = []
    for name, inner in invoke.findall(body):
        schema = tools.get(name.strip(), {})
        args = {}
        for key, value in parameter.findall(inner):
            key = key.strip() if strip_keys else key
            args[key] = _typed(_strip_one_newline(value), schema.get(key))
        calls.append(_call(name, args))
    return _all_or_none(calls)


def _qwen3_coder(body: str, tools: Tools) -> list[ToolCall] | None:
    return _xml_calls(body, tools, _FUNCTION, _PARAMETER, strip_keys=True)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm45(body: str, tools: Tools) -> list[ToolCall] | None:
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "\n" in name:
        return None
    schema = tools.get(name, {})
    args = {k.strip(): _typed(v, schema.get(k.strip())) for k, v in _GLM_ARG.findall(body)}
    call = _call(name, args)
    return [call] if call else None


_INVOKE = re.compile(r"<invoke name=\"([^\"]+)\">(.*?)</invoke>", re.S)
_MINIMAX_PARAM = re.compile(r"<parameter name=\"([^\"]+)\">(.*?)</parameter>", re.S)


def _minimax_m2(body: str, tools: Tools) -> list[ToolCall] | None:
    return _xml_calls(body, tools, _INVOKE, _MINIMAX_PARAM, strip_keys=False)


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _deepseek_v3(body: str, tools: Tools) -> list[ToolCall] | None:
    calls = []
    for inner in _DS_CALL.findall(body):
        left, sep, right = inner.partition("<｜tool▁sep｜>")
        if not sep:
            return None
        if left.strip() == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
            name, _, args = right.partition("\n")
        else:  # V3.1: NAME<sep>{...}
            name, args = left, right
        fenced = _FENCE.match(args.strip())
        calls.append(_call(name, _loads(fenced.group(1) if fenced else args.strip())))
    return _all_or_none(calls)


_DSML_INVOKE = re.compile(r"<｜DSML｜invoke name=\"([^\"]+)\">(.*?)</｜DSML｜invoke>", re.S)
_DSML_PARAM = re.compile(r"<｜DSML｜parameter name=\"([^\"]+)\"(?: string=\"(true|false)\")?>(.*?)</｜DSML｜parameter>",
                         re.S)


def _deepseek_v32(body: str, tools: Tools) -> list[ToolCall] | None:
    """DeepSeek-V3.2's DSML: ``string="true"`` values are text, ``"false"`` ones JSON (else typed by the schema)."""
    calls = []
    for name, inner in _DSML_INVOKE.findall(body):
        schema, args = tools.get(name.strip(), {}), {}
        for key, is_string, value in _DSML_PARAM.findall(inner):
            if is_string == "true":
                args[key] = value
            elif is_string == "false":
                parsed = _loads(value.strip())
                args[key] = value if parsed is None and value.strip() != "null" else parsed
            else:
                args[key] = _typed(value, schema.get(key))
        calls.append(_call(name, args))
    return _all_or_none(calls)


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                        re.S)


def _kimi_k2(body: str, tools: Tools) -> list[ToolCall] | None:
    calls = []
    for ident, args in _KIMI_CALL.findall(body):  # ident: functions.NAME:INDEX
        name = ident.removeprefix("functions.").rsplit(":", 1)[0]
        calls.append(_call(name, _loads(args.strip())))
    return _all_or_none(calls)


def _mistral(body: str, tools: Tools) -> list[ToolCall] | None:
    text = body.strip()
    if text.startswith("["):  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
        items = _loads(text)
        calls = [_json_call(o) for o in items] if isinstance(items, list) else [None]
    else:  # [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME2[ARGS]{...}
        calls = []
        for piece in text.split("[TOOL_CALLS]"):
            name, sep, args = piece.partition("[ARGS]")
            calls.append(_call(name, _loads(args.strip())) if sep else None)
    return _all_or_none(calls)


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    # detection order: the more specific marker first (qwen3_coder and glm45 also write <tool_call>)
    ToolFormat("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", _minimax_m2, "<minimax:tool_call>"),
    ToolFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _kimi_k2,
               "<|tool_calls_section_begin|>",
               ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    ToolFormat("deepseek_v32", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _deepseek_v32, "｜DSML｜",
               ("<｜DSML｜invoke", "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>")),
    ToolFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek_v3, "tool▁calls▁begin",
               ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")),
    ToolFormat("glm45", "<tool_call>", "</tool_call>", _glm45, "<arg_key>",
               ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>", _qwen3_coder, "<function="),
    ToolFormat("mistral", "[TOOL_CALLS]", None, _mistral, "[TOOL_CALLS]", ("[ARGS]",)),
    ToolFormat("hermes", "<tool_call>", "</tool_call>", _hermes, "<tool_call>"),
)}
REASONING_ALIASES = ("think", "qwen3", "deepseek_r1", "glm45", "minimax_m2", "kimi_k2", "ernie45")


def detect_tool_format(template_text: str) -> ToolFormat | None:
    """The markup a chat template tells its model to write tool calls in (None: none of the known ones)."""
    return next((f for f in TOOL_FORMATS.values() if f.marker in template_text), None)


def tool_format(name: str, template_text: str) -> ToolFormat | None:
    """``--tool-call-parser``: "auto" (from the template), "none", or a format name (ValueError listing them)."""
    if name == "auto":
        return detect_tool_format(template_text)
    if name == "none":
        return None
    if name not in TOOL_FORMATS:
        raise ValueError(f"tool-call parser {name!r} is unknown; known: auto, none, {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]


def reasoning_wanted(name: str, template_text: str, has_think_tokens: bool) -> bool:
    """``--reasoning-parser``: "auto" (the template or vocabulary knows ``<think>``), "none", or a known name."""
    if name == "auto":
        return has_think_tokens or THINK_OPEN in template_text
    if name == "none":
        return False
    if name not in REASONING_ALIASES:
        raise ValueError(f"reasoning parser {name!r} is unknown; known: auto, none, {', '.join(REASONING_ALIASES)}")
    return True


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside ``<think>`` (DeepSeek-R1/V3.1, GLM, thinking Qwen3 templates):
    the reply then starts with reasoning and no opening tag."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


def _partial_suffix(text: str, markers: list[str]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def split_text(text: str, tool: ToolFormat | None, tools: Tools, reasoning: bool, in_reasoning: bool,
               final: bool = True) -> Reply:
    """``text`` (a reply so far) by destination.

    ``reasoning``: split ``<think>...</think>``; ``in_reasoning``: the prompt opened it (the reply starts inside).
    ``tool``: the tool-call markup (None: no tool calls). Unless ``final``, tool calls are left out (they come
    whole at the end) and text that may still become markup is held back."""
    reply = Reply()
    if reasoning:
        body = text
        if not in_reasoning:
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                in_reasoning, body = True, stripped[len(THINK_OPEN):]
            elif not final and THINK_OPEN.startswith(stripped):
                return reply  # the reply may still open with <think>
        if in_reasoning:
            thought, closed, body = body.partition(THINK_CLOSE)
            if not closed:
                hold = 0 if final else _partial_suffix(thought, [THINK_CLOSE])
                reply.reasoning = thought[: len(thought) - hold].strip()
                return reply
            reply.reasoning, text = thought.strip(), body.lstrip()
    reply.content, reply.tool_calls = _split_tools(text, tool, tools, final)
    return reply


def _split_tools(text: str, tool: ToolFormat | None, tools: Tools, final: bool) -> tuple[str, list[ToolCall]]:
    if tool is None:
        return text, []
    content, calls, rest = [], [], text
    while True:
        at = rest.find(tool.start)
        if at < 0:
            hold = 0 if final else _partial_suffix(rest, [tool.start])
            content.append(rest[: len(rest) - hold])
            break
        content.append(rest[:at])
        if not final:
            break  # a call is being written: nothing after it is settled
        end = len(rest) if tool.end is None else rest.find(tool.end, at)
        if end < 0:  # never closed (cut by the token limit): keep it as text
            content.append(rest[at:])
            break
        stop = end + (0 if tool.end is None else len(tool.end))
        parsed = tool.parse(rest[at + len(tool.start): end], tools)
        if parsed is None:
            content.append(rest[at:stop])
        else:
            calls.extend(parsed)
        rest = rest[stop:]
    joined = "".join(content)
    # whitespace before a call is the call's layout, not content: trailing whitespace is held while streaming
    return (joined.rstrip() if calls or not final else joined), calls
