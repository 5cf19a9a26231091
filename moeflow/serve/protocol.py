"""OpenAI request and response bodies (the fields moeflow reads and writes), as pydantic models.

Unknown request fields are accepted and ignored, as OpenAI-compatible servers do, except those that would
change the output in a way moeflow does not implement (``echo``, a forced ``tool_choice``): those are
refused with a 400 naming the parameter, rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

MAX_CHOICES = 16  # ``n``: each choice is one engine sequence (a KV row while it runs)


class Unsupported(ValueError):
    """A request parameter moeflow does not implement (400, with ``param`` set)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions (a parameter left out takes the checkpoint's generation_config.json value)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    ignore_eos: bool = False  # go on past the end-of-turn tokens to max_tokens (benchmarks; vLLM's, llama.cpp's)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise Unsupported("stop", f"at most 4 stop sequences, got {len(stops)}")
        return [s for s in stops if s]

    def check_supported(self) -> None:
        """Unsupported for a parameter moeflow does not implement (the subclasses' own checks)."""

    def token_biases(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, each id checked against the vocabulary."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise Unsupported("logit_bias", f"logit_bias key {key!r} is not a token id") from None
            if not 0 <= token < vocab_size or not -100 <= bias <= 100:
                raise Unsupported("logit_bias", f"logit_bias {{{key!r}: {bias}}}: token ids lie in [0, "
                                                f"{vocab_size}), biases in [-100, 100]")
            out.append((token, float(bias)))
        return tuple(out)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into one string (images are refused)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise Unsupported("messages", f"content part of type {part.get('type')!r}: only text parts "
                                                  "are supported")
                texts.append(part["text"])
            data["content"] = "".join(texts)
        if "reasoning_content" in data:  # a reply sent back: transformers' templates (gpt-oss) read "thinking"
            data.setdefault("thinking", data["reasoning_content"])
        for call in data.get("tool_calls") or []:  # templates iterate the arguments (GLM's .items()): a dict
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    continue
                if isinstance(args, dict):
                    fn["arguments"] = args
        return data


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" / "none" / "required" / a named function
    parallel_tool_calls: bool = True  # False: a forced "required" reply is one call
    response_format: dict[str, Any] | None = None  # "text", "json_object", "json_schema" (guided decoding)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # harmony (gpt-oss) templates read it
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (as vLLM)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        named = isinstance(self.tool_choice, dict) and self.tool_choice.get("type") == "function"
        if self.tool_choice not in (None, "auto", "none", "required") and not named:
            raise Unsupported("tool_choice", f"tool_choice {self.tool_choice!r}: use 'auto', 'none', 'required' or "
                                             "{'type': 'function', 'function': {'name': ...}}")
        if self.forces_tool_call() and not self.tools:
            raise Unsupported("tool_choice", "tool_choice forces a tool call but the request gives no tools")
        if self.forces_tool_call() and self.response_format and self.response_format.get("type", "text") != "text":
            raise Unsupported("response_format", "response_format and a forced tool_choice both constrain the "
                                                 "reply: give one")

    # the tool_choice as the client's API wrote it, for errors (Anthropic's /v1/messages sets it; else OpenAI's)
    _tool_choice_sent: str | None = PrivateAttr(default=None)

    def tool_choice_as_sent(self) -> str:
        """``tool_choice`` as the client wrote it, for error messages."""
        if self._tool_choice_sent is not None:
            return self._tool_choice_sent
        return f"tool_choice {json.dumps(self.tool_choice)}"

    def forces_tool_call(self) -> bool:
        """``tool_choice`` "required" or a named function: the reply is held to tool calls (guided decoding)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def grammar(self) -> str | None:
        """``response_format`` as a grammar for guided decoding (None: plain text)."""
        from moeflow.chat.guided import GrammarError, response_format_grammar

        if self.response_format is None:
            return None
        try:
            return response_format_grammar(self.response_format)
        except GrammarError as e:
            raise Unsupported("response_format", str(e)) from e

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the chat template: ``chat_template_kwargs`` and ``reasoning_effort``."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & kwargs.keys()
        if reserved:
            raise Unsupported("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}")
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives'."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion) is not supported")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys the prefix cache held (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# a token's log-probability as the server hands it over: (text, logprob, [(alternative text, logprob)])
TokenLogprob = tuple[str, float, list[tuple[str, float]]]


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top]}
                        for t, lp, top in entries]}


def completion_logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


def chat_choice(index: int, message: dict[str, Any], finish: str,
                logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    """message: the assistant message ({"role", "content"}, and "reasoning_content" / "tool_calls")."""
    return {"index": index, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}


def chat_response(rid: str, model: str, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
            "usage": usage.model_dump()}


def chat_chunk(rid: str, model: str, delta: dict[str, Any], finish: str | None,
               logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish}]}


def completion_choice(index: int, text: str, finish: str,
                      logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish}


def completion_response(rid: str, model: str, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": usage.model_dump()}


def completion_chunk(rid: str, model: str, text: str, finish: str | None,
                     logprobs: list[TokenLogprob] | None = None, offset: int = 0, index: int = 0) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": completion_logprobs(logprobs, offset),
                         "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: Literal["chat.completion.chunk", "text_completion"],
                usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": now(), "model": model, "choices": [], "usage": usage.model_dump()}
