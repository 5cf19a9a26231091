"""The FastAPI app: OpenAI's chat and text completion routes (plain and server-sent events), models, health,
metrics, and the API-key check.

Requests become engine sequences (:class:`~moeflow.engine.continuous.ContinuousEngine`); the engine thread
reports tokens through a callback that hands them to the request's asyncio queue. A client that goes away
(a closed stream, or a dropped connection while waiting for a plain response) cancels its sequence, which
frees its KV row at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.guided import GuideFactory
from moeflow.io.chat_template import ChatTemplate, stop_token_ids
from moeflow.io.reply_formats import THINK_CLOSE
from moeflow.serve import protocol as p
from moeflow.serve.errors import APIError, error_body, install_handlers
from moeflow.serve.metrics import ServeMetrics
from moeflow.serve.text import ChatReplies, MarkupAssembler, TextAssembler

DISCONNECT_POLL_S = 0.1  # how often a plain (non-streamed) request checks that its client is still there


class ServeState:
    """What the routes share: the model, its engine, tokenizer, chat template and the served name."""

    def __init__(self, model, engine: ContinuousEngine, metrics: ServeMetrics, model_name: str,
                 aliases: tuple[str, ...] = (), tool_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        if model.tokenizer is None:
            raise ValueError(f"{model.name_or_path} has no tokenizer.json: the server needs one")
        self.model, self.engine, self.metrics = model, engine, metrics
        self.tokenizer, self.model_name = model.tokenizer, model_name
        self.names = {model_name, *aliases}
        self.template = ChatTemplate.from_directory(model.tokenizer.path.parent)
        self.stop_ids = stop_token_ids(self.template, model.generation_config.eos_ids(), self.tokenizer.encode)
        # chat replies split into content / reasoning_content / tool_calls: harmony (gpt-oss) or text markup
        template_text = "\n".join(self.template.templates.values()) if self.template is not None else None
        self.replies = ChatReplies(self.tokenizer, template_text, tool_parser, reasoning_parser)
        # guided decoding (response_format): the vocabulary's token set for the grammar engine, built once
        self.guides = GuideFactory(self.tokenizer.path, model.config.vocab_size, list(self.stop_ids))

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist: this server serves '{self.model_name}'",
                           "model", "model_not_found")

    def sampling(self, req: p.SamplingFields, limit: int | None, prompt_tokens: int) -> SamplingParams:
        """OpenAI's parameters over the checkpoint's generation_config defaults (temperature 0: greedy)."""
        gen = self.model.generation_config
        if limit is None:  # as generate(): the checkpoint's max_new_tokens, within the context that is left
            limit = max(1, min(gen.max_new_tokens, self.engine.cache.max_len - prompt_tokens))
        do_sample = gen.do_sample if req.temperature is None else req.temperature > 0
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return SamplingParams(
            max_new_tokens=limit, do_sample=do_sample,
            temperature=gen.temperature if req.temperature in (None, 0) else req.temperature,
            top_k=gen.top_k if req.top_k is None else (None if req.top_k in (0, -1) else req.top_k),
            top_p=pick(req.top_p, gen.top_p), min_p=pick(req.min_p, gen.min_p), seed=req.seed,
            stop_token_ids=self.stop_ids, logprobs=req.logprob_count(),
            repetition_penalty=pick(req.repetition_penalty, gen.repetition_penalty),
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=req.token_biases(self.model.config.vocab_size),
        )

    def logprobs(self, seq, start: int, end: int) -> list[p.TokenLogprob] | None:
        """Log-probabilities of generated tokens [start, end) with token texts, or None when not asked for."""
        if seq.params.logprobs is None:
            return None
        piece = lambda i: self.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
        return [(piece(seq.generated[i]), lp, [(piece(a), alp) for a, alp in top])
                for i, (lp, top) in enumerate(seq.logprobs[start:end], start)]

    async def complete(self, request: Request, kind: str, req: p.SamplingFields, ids: list[int],
                       prompt: str = "") -> Response:
        """Run one request (``prompt``: a chat request's rendered text): a JSON body, or an SSE stream when
        ``req.stream``."""
        req.check_supported()
        params = self.sampling(req, req.token_limit(), len(ids))
        guide = None
        if isinstance(req, p.ChatCompletionRequest):
            text = self.replies.assembler(req.stop_strings(), set(self.stop_ids), prompt, req.tools, req.tool_choice)
            grammar = req.grammar()
            if grammar is not None:  # a reply that starts in <think> reasons freely, then answers in the grammar
                thinks = isinstance(text, MarkupAssembler) and text.in_reasoning
                guide = self.guides.guide(grammar, self.stop_ids,
                                          self.tokenizer.token_id(THINK_CLOSE) if thinks else None)
        else:
            text = TextAssembler(self.tokenizer.decode, req.stop_strings(), set(self.stop_ids))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(token: int | None, reason: str | None) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (token, reason))
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

        stop_check = text.hits_stop_string if text.stop_strings else None
        seq = self.engine.submit(ids, params, on_event, stop_check, guide)
        rid = p.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if req.stream:
            return StreamingResponse(self._stream(kind, req, rid, seq, events, text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            reason = await _wait_for_end(request, events)
        finally:
            seq.cancel()  # no-op when finished; frees the row when the client left
        if reason is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        if reason == "error":
            raise APIError(500, f"generation failed: {seq.error}")
        usage = _usage(len(ids), seq.generated)
        logprobs = self.logprobs(seq, 0, len(seq.generated))
        if kind == "chat":
            body = p.chat_response(rid, self.model_name, text.message(seq.generated),
                                   text.finish(seq.generated, reason), usage, logprobs)
        else:
            body = p.completion_response(rid, self.model_name, text.text(seq.generated), _finish(reason), usage,
                                         logprobs)
        return JSONResponse(body)

    async def _stream(self, kind: str, req: p.SamplingFields, rid: str, seq, events: asyncio.Queue,
                      text: TextAssembler) -> AsyncIterator[str]:
        name = self.model_name
        ids: list[int] = []  # the tokens reported so far (the engine may already be further on)
        lp_sent, offset = 0, 0  # tokens whose log-probabilities went out; text offset for completions

        def chunk(delta: str | dict, finish: str | None = None) -> str:
            nonlocal lp_sent, offset
            logprobs = self.logprobs(seq, lp_sent, len(ids))
            lp_sent = len(ids)
            if kind == "chat":  # delta: the chat delta's fields
                return _sse(p.chat_chunk(rid, name, delta, finish, logprobs))
            out = _sse(p.completion_chunk(rid, name, delta, finish, logprobs, offset))
            offset += sum(len(t) for t, _, _ in logprobs or [])
            return out

        try:
            if kind == "chat":
                yield _sse(p.chat_chunk(rid, name, {"role": "assistant", "content": ""}, None))
            while True:
                token, reason = await events.get()
                if reason is None:
                    ids.append(token)
                    delta = text.delta_fields(ids, final=False) if kind == "chat" else text.delta(ids, final=False)
                    if delta:
                        yield chunk(delta)
                    continue
                if reason == "error":
                    yield _sse(error_body(500, f"generation failed: {seq.error}"))
                    break
                delta = text.delta_fields(ids, final=True) if kind == "chat" else text.delta(ids, final=True)
                if delta:
                    yield chunk(delta)
                finish = text.finish(ids, reason) if kind == "chat" else _finish(reason)
                yield chunk({} if kind == "chat" else "", finish)
                if req.include_usage():
                    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                    yield _sse(p.usage_chunk(rid, name, obj, _usage(len(seq.prompt_ids), ids)))
                break
            yield "data: [DONE]\n\n"
        finally:
            seq.cancel()  # the client closed the stream (or it ended): free the row if still running


async def _wait_for_end(request: Request, events: asyncio.Queue) -> str | None:
    """The finish reason, or None when the client disconnected first (checked every DISCONNECT_POLL_S)."""
    loop = asyncio.get_running_loop()
    getter = asyncio.ensure_future(events.get())  # one getter across polls: no event is dropped by a timeout
    next_check = loop.time() + DISCONNECT_POLL_S
    while True:
        done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - loop.time()))
        if done:
            token, reason = getter.result()
            if reason is not None:
                return reason
            getter = asyncio.ensure_future(events.get())
        if loop.time() >= next_check:
            if await request.is_disconnected():
                getter.cancel()
                return None
            next_check = loop.time() + DISCONNECT_POLL_S


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(prompt_tokens: int, generated: list[int]) -> p.Usage:
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(generated),
                   total_tokens=prompt_tokens + len(generated))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _KeyAndCount:
    """ASGI middleware: the API key on every route but /health (before the body is read), and request counts."""

    def __init__(self, app, api_key: str | None, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path.startswith("/v1/") or path in ("/health", "/metrics") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse(error_body(401, "Incorrect API key provided: pass it as "
                                                   "'Authorization: Bearer KEY' (--api-key)", None,
                                                   "invalid_api_key"), status_code=401)
                return await response(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)


def create_app(model, engine: ContinuousEngine, metrics: ServeMetrics, model_name: str,
               api_key: str | None = None, aliases: tuple[str, ...] = (), tool_parser: str = "auto",
               reasoning_parser: str = "auto") -> FastAPI:
    """The server for ``model``; the engine thread starts with the app and stops with it. ``tool_parser`` /
    ``reasoning_parser``: how chat replies are split (:class:`~moeflow.serve.text.ChatReplies`)."""
    state = ServeState(model, engine, metrics, model_name, aliases, tool_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="moeflow", lifespan=lifespan)
    app.state.serve = state
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: p.ChatCompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        if state.template is None:
            raise APIError(400, f"{state.model_name} ships no chat template: use /v1/completions", "messages")
        messages = [m.as_template_input() for m in req.messages]
        prompt = state.template.render(messages, add_generation_prompt=True, tools=req.tools, **req.template_kwargs())
        ids = state.tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote the special tokens
        return await state.complete(request, "chat", req, ids, prompt)

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request: send one per request", "prompt")
            prompt = prompt[0]
        ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await state.complete(request, "completion", req, ids)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": p.now(),
                                            "owned_by": "moeflow", "max_model_len": engine.cache.max_len}]}

    @app.get("/health")
    async def health() -> Response:
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_KeyAndCount, api_key=api_key, metrics=metrics)
    return app
