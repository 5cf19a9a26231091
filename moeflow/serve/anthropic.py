"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the same engine, so tools
written for it (Claude Code with ``ANTHROPIC_BASE_URL``, the ``anthropic`` SDK) run on a local model.

A request becomes the OpenAI-shaped chat request the rest of the server runs (:func:`chat_request`): ``system``
a system message, ``tool_use`` blocks assistant ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``tools``' ``input_schema`` function parameters, ``tool_choice`` auto / any / tool / none as auto / required /
named / none (forced calls by guided decoding; ``disable_parallel_tool_use`` as ``parallel_tool_calls=False``).
The reply, split as for OpenAI clients (reasoning, text, tool calls: :mod:`moeflow.serve.text`), becomes
``thinking``, ``text`` and ``tool_use`` content blocks; streamed, as Anthropic's events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). The ``model`` a client
names is echoed, not checked: Anthropic clients send their own names.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moeflow.serve import protocol as p
from moeflow.serve.choices import wait_for_ends
from moeflow.serve.errors import APIError


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # required by /v1/messages, unused by count_tokens
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (any other block refused by name)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if block.get("type") != "text":
            raise p.Unsupported(where, f"{where}: content blocks of type {block.get('type')!r} are not supported here")
        parts.append(block.get("text", ""))
    return "".join(parts)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic messages (and ``system``) as chat-template messages in OpenAI's shape."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for m in req.messages:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise p.Unsupported("messages", f"message role {role!r}: Anthropic messages are 'user' or 'assistant'")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text, thinking, calls = [], [], []
        for block in content or []:
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text", ""))
            elif kind == "thinking" and role == "assistant":
                thinking.append(block.get("thinking", ""))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(result, "tool_result") if result is not None else ""})
            elif kind not in ("redacted_thinking",):
                raise p.Unsupported("messages", f"content blocks of type {kind!r} are not supported")
        if text or calls or thinking or not out or out[-1]["role"] != "tool":
            message: dict[str, Any] = {"role": role, "content": "".join(text)}
            if thinking:
                message["reasoning_content"] = "".join(thinking)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def chat_request(req: MessagesRequest) -> p.ChatCompletionRequest:
    """The OpenAI-shaped request the server runs for ``req``."""
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema") or {"type": "object"}}}
             for t in req.tools or []]
    choice: str | dict | None = None
    kind = (req.tool_choice or {}).get("type")
    if kind in ("auto", "none"):
        choice = kind
    elif kind == "any":
        choice = "required"
    elif kind == "tool":
        choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif kind is not None:
        raise p.Unsupported("tool_choice", f"tool_choice type {kind!r}: use auto, any, tool or none")
    chat = p.ChatCompletionRequest(
        model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences or None, stream=req.stream,
        tools=tools or None, tool_choice=choice,
        parallel_tool_calls=not (req.tool_choice or {}).get("disable_parallel_tool_use", False))
    if req.tool_choice is not None:
        chat._tool_choice_sent = f"tool_choice {json.dumps(req.tool_choice)}"  # errors quote Anthropic's form
    return chat


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The assembler's OpenAI message as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                       "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])})
    return blocks


def _stop(choice, reason: str, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if reason == "length":
        return "max_tokens", None
    if choice.text.finish(choice.seq.generated, reason) == "tool_calls":
        return "tool_use", None
    raw = choice.text.decode(choice.seq.generated)
    hit = min(((raw.find(s), s) for s in stops if s in raw), default=None)
    return ("stop_sequence", hit[1]) if hit else ("end_turn", None)


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n"


def install(app, state) -> None:
    """Mount ``/v1/messages`` and ``/v1/messages/count_tokens`` on ``app`` (``state``: the server's ServeState)."""
    def prompt_of(req: MessagesRequest) -> tuple[p.ChatCompletionRequest, str, list[int]]:
        if state.template is None:
            raise APIError(400, f"{state.model_name} ships no chat template: /v1/messages needs one", "messages")
        chat = chat_request(req)
        messages = [m.as_template_input() for m in chat.messages]
        prompt = state.template.render(messages, add_generation_prompt=True, tools=chat.tools)
        return chat, prompt, state.tokenizer.encode(prompt, add_special_tokens=False)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: MessagesRequest) -> dict:
        return {"input_tokens": len(prompt_of(req)[2])}

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Response:
        if req.max_tokens is None:  # no default: Anthropic's API refuses such a request too
            raise APIError(400, "max_tokens: Field required (Anthropic's Messages API requires max_tokens, the most "
                                "tokens the reply may have)", "max_tokens")
        chat, prompt, ids = prompt_of(req)
        chat.check_supported()
        [choice], events = state.submit("chat", chat, ids, prompt)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream(req, mid, choice, events, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            reasons = await wait_for_ends(request, events, 1)
        finally:
            choice.seq.cancel()
        if reasons is None:
            return Response(status_code=499)
        if reasons[0] == "error":
            raise APIError(500, f"generation failed: {choice.seq.error}")
        stop_reason, stop_sequence = _stop(choice, reasons[0], req.stop_sequences or [])
        return JSONResponse({
            "id": mid, "type": "message", "role": "assistant", "model": req.model,
            "content": _blocks(choice.text.message(choice.seq.generated)), "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(ids), "output_tokens": len(choice.seq.generated)}})

    async def _stream(req: MessagesRequest, mid: str, choice, events, n_prompt: int) -> AsyncIterator[str]:
        yield _sse("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": req.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
        index, open_kind = -1, None  # the content block being written

        def switch(kind: str, start: dict[str, Any]) -> list[str]:
            nonlocal index, open_kind
            out = [_sse("content_block_stop", {"index": index})] if open_kind is not None else []
            index, open_kind = index + 1, kind
            return [*out, _sse("content_block_start", {"index": index, "content_block": start})]

        try:
            while True:
                _, token, reason = await events.get()
                final = reason is not None
                if token is not None:
                    choice.ids.append(token)
                if reason == "error":
                    yield _sse("error", {"error": {"type": "api_error", "message": str(choice.seq.error)}})
                    return
                delta = choice.text.delta_fields(choice.ids, final)
                for field, kind, start, key in (
                        ("reasoning_content", "thinking", {"type": "thinking", "thinking": ""}, "thinking_delta"),
                        ("content", "text", {"type": "text", "text": ""}, "text_delta")):
                    if delta.get(field):
                        if open_kind != kind:
                            for event in switch(kind, start):
                                yield event
                        name = "thinking" if kind == "thinking" else "text"
                        yield _sse("content_block_delta", {"index": index, "delta": {"type": key, name: delta[field]}})
                for call in delta.get("tool_calls") or []:
                    for event in switch("tool_use", {"type": "tool_use", "name": call["function"]["name"], "input": {},
                                                     "id": "toolu_" + call["id"].removeprefix("call_")}):
                        yield event
                    yield _sse("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
                if final:
                    break
            if open_kind is not None:
                yield _sse("content_block_stop", {"index": index})
            stop_reason, stop_sequence = _stop(choice, reason, req.stop_sequences or [])
            yield _sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                         "usage": {"output_tokens": len(choice.ids)}})
            yield _sse("message_stop", {})
        finally:
            choice.seq.cancel()
