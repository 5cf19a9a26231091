"""One request's choices while the engine runs them: each choice's sequence and reply assembler, and the wait for
their ends that notices a client who went away (shared by the OpenAI routes and Anthropic's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from moeflow.serve.text import TextAssembler

DISCONNECT_POLL_S = 0.1  # how often a plain (non-streamed) request checks that its client is still there


@dataclass
class Choice:
    """One choice of a request: its engine sequence, reply assembler, and what a stream has sent of it."""

    seq: Any
    text: TextAssembler
    ids: list[int] = field(default_factory=list)  # the tokens reported so far (the engine may be further on)
    lp_sent: int = 0  # tokens whose log-probabilities went out
    offset: int = 0  # text offset (completions' logprobs)


async def wait_for_ends(request: Request, events: asyncio.Queue, n: int) -> list[str] | None:
    """Each of ``n`` choices' finish reason, or None when the client disconnected first (checked every
    DISCONNECT_POLL_S)."""
    loop = asyncio.get_running_loop()
    reasons: list[str | None] = [None] * n
    getter = asyncio.ensure_future(events.get())  # one getter across polls: no event is dropped by a timeout
    next_check = loop.time() + DISCONNECT_POLL_S
    while True:
        done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - loop.time()))
        if done:
            i, token, reason = getter.result()
            if reason is not None:
                reasons[i] = reason
                if all(r is not None for r in reasons):
                    return reasons  # type: ignore[return-value]
            getter = asyncio.ensure_future(events.get())
        if loop.time() >= next_check:
            if await request.is_disconnected():
                getter.cancel()
                return None
            next_check = loop.time() + DISCONNECT_POLL_S
