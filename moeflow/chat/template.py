"""Chat templates as checkpoints ship them, rendered with jinja2 under transformers' conventions.

Where the template comes from: ``chat_template.jinja`` beside the tokenizer when present, else the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` where
"default" is used, or "tool_use" when tools are passed and the checkpoint has one), else, for a gpt-oss
checkpoint (``model_type`` "gpt_oss"), moeflow's own rendering of the harmony format
(``moeflow/data/chat_templates/harmony.jinja``, checked against the openai-harmony package in tests).

What the template sees (as in transformers' ``apply_chat_template``): ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``), any extra keyword, the function
``raise_exception(message)`` and ``strftime_now(format)``, and a ``tojson`` filter that keeps non-ASCII
text as is. Blocks trim their newline and leading blanks (``trim_blocks``, ``lstrip_blocks``), loop
controls are on, and the sandbox forbids touching Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from moeflow.errors import CheckpointError, InputError

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
HARMONY_TEMPLATE = Path(__file__).resolve().parent.parent / "data" / "chat_templates" / "harmony.jinja"
HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")  # a harmony reply ends with its answer or with a tool call


class ChatTemplateError(InputError):
    """The conversation was refused by the template (its ``raise_exception``) or is malformed."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters and sorts keys; templates expect plain json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A checkpoint's chat template(s) plus its special tokens. ``render`` turns messages into the prompt text."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str | None], source: str) -> None:
        self.templates, self.special_tokens, self.source = templates, special_tokens, source

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of the checkpoint in ``directory``, or None when it ships none."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{config_path} is not valid JSON: {e}") from e
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            return cls({"default": jinja_path.read_text(encoding="utf-8")}, special, str(jinja_path))
        raw = config.get("chat_template")
        if raw is None:
            return harmony_template(special) if _model_type(directory) == "gpt_oss" else None
        if isinstance(raw, str):
            return cls({"default": raw}, special, str(config_path))
        if isinstance(raw, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in raw):
            return cls({t["name"]: t["template"] for t in raw}, special, str(config_path))
        raise CheckpointError(f"{config_path}: chat_template must be a string or a list of "
                              "{'name', 'template'} objects")

    def select(self, tools: list | None) -> str:
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise CheckpointError(f"{self.source}: several chat templates ({sorted(self.templates)}) and none is "
                              "named 'default'")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text for ``messages`` (each a dict with "role" and "content", as OpenAI sends them)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
        from jinja2 import TemplateError

        context = {**self.special_tokens, **kwargs}
        try:
            return _compile(self.select(tools)).render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **context,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"{self.source}: rendering the chat template failed: {e}") from e

    def end_of_turn_ids(self, encode) -> list[int]:
        """The template's end-of-turn tokens: ``eos_token`` when it encodes to exactly one id, and for a harmony
        template (one that writes ``<|return|>`` and ``<|call|>``) those two, each when it is one id."""
        ends = [self.special_tokens.get("eos_token")]
        sources = " ".join(self.templates.values())
        if all(end in sources for end in HARMONY_TURN_ENDS):
            ends += HARMONY_TURN_ENDS
        out = []
        for end in ends:
            ids = encode(end, add_special_tokens=False) if end else []
            if len(ids) == 1:
                out.append(ids[0])
        return list(dict.fromkeys(out))


def _model_type(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def harmony_template(special_tokens: dict[str, str | None] | None = None) -> ChatTemplate:
    """moeflow's harmony template (gpt-oss), with ``special_tokens`` (``eos_token`` defaults to ``<|return|>``)."""
    special = {name: None for name in SPECIAL_TOKENS} | dict(special_tokens or {})
    special["eos_token"] = special["eos_token"] or "<|return|>"
    return ChatTemplate({"default": HARMONY_TEMPLATE.read_text(encoding="utf-8")}, special, str(HARMONY_TEMPLATE))


def chat_template_for(directory: str | Path) -> ChatTemplate:
    """The chat template of the checkpoint in ``directory``; a clear error when it ships none."""
    template = ChatTemplate.from_directory(directory)
    if template is None:
        raise CheckpointError(f"{directory} ships no chat template (no chat_template.jinja, no chat_template in "
                              "tokenizer_config.json): send plain prompts (/v1/completions, generate --prompt)")
    return template


def stop_token_ids(template: ChatTemplate | None, eos_ids: list[int], encode) -> tuple[int, ...]:
    """Tokens that end a chat reply: generation_config.json's ``eos_token_id`` list plus the template's
    end-of-turn token, in that order, without repeats."""
    eot = template.end_of_turn_ids(encode) if template is not None else []
    return tuple(dict.fromkeys([*eos_ids, *eot]))
