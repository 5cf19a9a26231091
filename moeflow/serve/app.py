"""The FastAPI app: OpenAI's chat and text completion routes (plain and server-sent events), models, health,
metrics, and the API-key check.

Requests become engine sequences (:class:`~moeflow.engine.continuous.ContinuousEngine`); the engine thread
reports tokens through a callback that hands them to the request's asyncio queue (through a
:class:`~moeflow.serve.wake.LoopWaker`, so that the report does not release the engine's GIL). A client that goes away
(a closed stream, or a dropped connection while waiting for a plain response) cancels its sequence, which
frees its KV row at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from moeflow.chat.guided import GrammarError, Guide, GuideFactory
from moeflow.chat.reply_formats import THINK_CLOSE
from moeflow.chat.template import ChatTemplate, stop_token_ids
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.serve import anthropic
from moeflow.serve import protocol as p
from moeflow.serve.choices import Choice, wait_for_ends
from moeflow.serve.errors import APIError, error_body, install_handlers
from moeflow.serve.metrics import ServeMetrics
from moeflow.serve.text import ChatReplies, MarkupAssembler, TextAssembler
from moeflow.serve.wake import LoopWaker

log = logging.getLogger(__name__)


class ServeState:
    """What the routes share: the model, its engine, tokenizer, chat template and the served name."""

    def __init__(self, model, engine: ContinuousEngine, metrics: ServeMetrics, model_name: str,
                 aliases: tuple[str, ...] = (), tool_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        if model.tokenizer is None:
            raise ValueError(f"{model.name_or_path} has no tokenizer.json: the server needs one")
        self.model, self.engine, self.metrics = model, engine, metrics
        self.tokenizer, self.model_name = model.tokenizer, model_name
        self.names = {model_name, *aliases}
        self._waker: LoopWaker | None = None
        self.template = ChatTemplate.from_directory(model.tokenizer.path.parent)
        self.stop_ids = stop_token_ids(self.template, model.generation_config.eos_ids(), self.tokenizer.encode)
        # chat replies split into content / reasoning_content / tool_calls: harmony (gpt-oss) or text markup
        template_text = "\n".join(self.template.templates.values()) if self.template is not None else None
        self.replies = ChatReplies(self.tokenizer, template_text, tool_parser, reasoning_parser)
        # guided decoding (response_format): the vocabulary's token set for the grammar engine, built once
        self.guides: GuideFactory | None = None
        try:
            self.guides = GuideFactory(self.tokenizer.path, model.config.vocab_size, list(self.stop_ids))
        except Exception as e:  # a tokenizer the grammar engine cannot read: serve, refuse guided requests by name
            self.guides_error = f"guided decoding is not available for {self.tokenizer.path}: {e}"
            log.warning(self.guides_error)

    def waker(self, loop: asyncio.AbstractEventLoop) -> LoopWaker:
        """The engine thread's way to hand token events to ``loop`` (one per event loop the app runs on)."""
        if self._waker is None or self._waker.loop is not loop:
            self.close_waker()
            self._waker = LoopWaker(loop)
        return self._waker

    def close_waker(self) -> None:
        if self._waker is not None:
            self._waker.close()
            self._waker = None

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
            stop_token_ids=() if req.ignore_eos else self.stop_ids, logprobs=req.logprob_count(),
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
        """Run one request (``prompt``: a chat request's rendered text; ``req.n`` choices, each its own engine
        sequence, seeded ``seed + i``): a JSON body, or an SSE stream when ``req.stream``."""
        req.check_supported()
        choices, events = self.submit(kind, req, ids, prompt)
        rid = p.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if req.stream:
            return StreamingResponse(self._stream(kind, req, rid, choices, events),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            reasons = await wait_for_ends(request, events, len(choices))
        finally:
            for c in choices:
                c.seq.cancel()  # no-op when finished; frees the row when the client left
        if reasons is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        failed = [c.seq.error for c in choices if c.seq.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0]}")
        usage = _usage(len(ids), [t for c in choices for t in c.seq.generated], choices[0].seq.cached_tokens)
        out = []
        for i, c in enumerate(choices):
            gen, reason, logprobs = c.seq.generated, reasons[i], self.logprobs(c.seq, 0, len(c.seq.generated))
            out.append(p.chat_choice(i, c.text.message(gen), c.text.finish(gen, reason), logprobs) if kind == "chat"
                       else p.completion_choice(i, c.text.text(gen), c.text.finish(gen, reason), logprobs))
        body = (p.chat_response if kind == "chat" else p.completion_response)(rid, self.model_name, out, usage)
        return JSONResponse(body)

    def submit(self, kind: str, req: p.SamplingFields, ids: list[int], prompt: str
               ) -> tuple[list[Choice], asyncio.Queue]:
        """Queue ``req.n`` engine sequences for ``ids`` (seeded ``seed + i``): their choices, and the queue the
        engine thread reports (choice, token, reason) into."""
        params = self.sampling(req, req.token_limit(), len(ids))
        waker = self.waker(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        try:
            for i in range(req.n):
                text, guide = self._assembler(kind, req, prompt)

                def on_event(token: int | None, reason: str | None, i: int = i) -> None:  # engine thread
                    waker.post(events.put_nowait, (i, token, reason))

                seeded = params if req.seed is None else replace(params, seed=req.seed + i)
                stop_check = text.hits_stop_string if text.stop_strings else None
                choices.append(Choice(self.engine.submit(ids, seeded, on_event, stop_check, guide), text))
        except BaseException:
            for c in choices:
                c.seq.cancel()
            raise
        return choices, events

    def _assembler(self, kind: str, req: p.SamplingFields, prompt: str) -> tuple[TextAssembler, Guide | None]:
        """One choice's reply assembler, and its grammar state when ``response_format`` asks for one."""
        if not isinstance(req, p.ChatCompletionRequest):
            return TextAssembler(self.tokenizer.decode, req.stop_strings(), set(self.stop_ids)), None
        text = self.replies.assembler(req.stop_strings(), set(self.stop_ids), prompt, req.tools, req.tool_choice,
                                      req.forces_tool_call())
        grammar = (self.replies.forced_call_grammar(req.tools, req.tool_choice, prompt, req.parallel_tool_calls,
                                                    req.tool_choice_as_sent())
                   if req.forces_tool_call() else req.grammar())
        if grammar is None:
            return text, None
        # a reply that starts in <think> reasons freely, then answers in the grammar
        thinks = isinstance(text, MarkupAssembler) and text.in_reasoning
        if self.guides is None:
            raise p.Unsupported("tool_choice" if req.forces_tool_call() else "response_format", self.guides_error)
        try:
            return text, self.guides.guide(grammar, self.stop_ids,
                                           self.tokenizer.token_id(THINK_CLOSE) if thinks else None)
        except GrammarError as e:
            raise p.Unsupported("tool_choice" if req.forces_tool_call() else "response_format", str(e)) from e

    async def _stream(self, kind: str, req: p.SamplingFields, rid: str, choices: list[Choice],
                      events: asyncio.Queue) -> AsyncIterator[str]:
        name = self.model_name

        def chunk(i: int, delta: str | dict, finish: str | None = None) -> str:
            c = choices[i]
            logprobs = self.logprobs(c.seq, c.lp_sent, len(c.ids))
            c.lp_sent = len(c.ids)
            if kind == "chat":  # delta: the chat delta's fields
                return _sse(p.chat_chunk(rid, name, delta, finish, logprobs, index=i))
            out = _sse(p.completion_chunk(rid, name, delta, finish, logprobs, c.offset, index=i))
            c.offset += sum(len(t) for t, _, _ in logprobs or [])
            return out

        try:
            if kind == "chat":
                for i in range(len(choices)):
                    yield _sse(p.chat_chunk(rid, name, {"role": "assistant", "content": ""}, None, index=i))
            running = len(choices)
            while running:
                i, token, reason = await events.get()
                c = choices[i]
                if reason is None:
                    c.ids.append(token)
                    delta = c.text.delta_fields(c.ids, False) if kind == "chat" else c.text.delta(c.ids, False)
                    if delta:
                        yield chunk(i, delta)
                    continue
                running -= 1
                if reason == "error":
                    yield _sse(error_body(500, f"generation failed: {c.seq.error}"))
                    break
                delta = c.text.delta_fields(c.ids, True) if kind == "chat" else c.text.delta(c.ids, True)
                if delta:
                    yield chunk(i, delta)
                yield chunk(i, {} if kind == "chat" else "", c.text.finish(c.ids, reason))
            if req.include_usage() and not running:
                obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                yield _sse(p.usage_chunk(rid, name, obj, _usage(len(choices[0].seq.prompt_ids),
                                                                [t for c in choices for t in c.ids],
                                                                choices[0].seq.cached_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                c.seq.cancel()  # the client closed the stream (or it ended): free the row if still running


def _usage(prompt_tokens: int, generated: list[int], cached: int = 0) -> p.Usage:
    """The prompt counted once (``cached``: its tokens the prefix cache held, by the first choice's sequence)."""
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(generated),
                   total_tokens=prompt_tokens + len(generated),
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


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
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers:  # Anthropic's clients send the key this way
                given = b"Bearer " + headers[b"x-api-key"]
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse(error_body(401, "Incorrect API key provided: pass it as "
                                                   "'Authorization: Bearer KEY' or 'x-api-key: KEY' (--api-key)",
                                                   None, "invalid_api_key"), status_code=401)
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
            state.close_waker()

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

    anthropic.install(app, state)  # Anthropic's Messages API over the same engine
    app.add_middleware(_KeyAndCount, api_key=api_key, metrics=metrics)
    return app
