"""gpt-oss replies in OpenAI's harmony format, split into their channels.

A harmony prompt ends with ``<|start|>assistant``; the model then writes one or more messages, each a header and
a body: ``<|channel|>analysis<|message|>...<|end|>``, ``<|start|>assistant<|channel|>final<|message|>...<|return|>``,
or a tool call ``<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>``.
``<|return|>`` and ``<|call|>`` end the turn (the generation's stop tokens); ``<|end|>`` ends one message only.

:func:`split_reply` turns the generated ids into what an OpenAI client expects: the final channel's text
(``message.content``), the analysis channel's (``reasoning_content``, as vLLM and others name it) and the tool
calls. The split works on token ids (the markup tokens are special tokens), so it never mistakes text that
looks like markup for markup.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from moeflow.chat.reply_formats import Reply, ToolCall

MARKUP = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony markup tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    ret: int
    call: int
    constrain: int

    @property
    def message_ends(self) -> tuple[int, int, int]:
        return (self.end, self.ret, self.call)


def harmony_tokens(tokenizer) -> HarmonyTokens | None:
    """The markup ids when ``tokenizer`` (a :class:`moeflow.io.tokenizer.Tokenizer`) speaks harmony, else None."""
    ids = [tokenizer.token_id(t) for t in MARKUP]
    if any(i is None for i in ids):
        return None
    return HarmonyTokens(*ids)


@dataclass
class HarmonyMessage:
    """One message of a reply: its header fields and body ids (``done`` once its end token arrived)."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    ids: list[int] = field(default_factory=list)
    done: bool = False


_HEADER = re.compile(r"<\|channel\|>\s*(?P<channel>[^\s<]+)|to=(?P<recipient>[^\s<]+)"
                     r"|<\|constrain\|>\s*(?P<ctype>[^\s<]+)")


def parse_header(text: str, message: HarmonyMessage) -> None:
    """Fill ``message``'s channel, recipient and content type from its header text (the role already stripped
    or still in front: ``assistant to=functions.f<|channel|>commentary <|constrain|>json``)."""
    for m in _HEADER.finditer(text):
        if m.group("channel"):
            message.channel = m.group("channel")
        elif m.group("recipient"):
            message.recipient = m.group("recipient")
        elif m.group("ctype"):
            message.content_type = m.group("ctype")


def parse_reply(ids: list[int], tokens: HarmonyTokens,
                decode: Callable[..., str]) -> tuple[list[HarmonyMessage], list[int]]:
    """The messages in generated ``ids`` and the ids of a header not yet closed by ``<|message|>``.

    The reply starts inside a header (the prompt wrote ``<|start|>assistant``). Tokens between a message's end
    and the next ``<|start|>`` (none in a well-formed reply) are kept as a message without a channel.
    """
    messages: list[HarmonyMessage] = []
    header: list[int] = []
    body: HarmonyMessage | None = None
    for t in ids:
        if body is not None:
            if t in tokens.message_ends:
                body.done = True
                body = None
            else:
                body.ids.append(t)
        elif t == tokens.message:
            body = HarmonyMessage()
            parse_header(decode(header, skip_special_tokens=False), body)
            messages.append(body)
            header = []
        elif t == tokens.start:
            header = []
        else:
            header.append(t)
    return messages, header


def split_reply(ids: list[int], tokens: HarmonyTokens, decode: Callable[..., str], final: bool = True) -> Reply:
    """The reply in ``ids`` by destination: the final channel is the content, the analysis channel the reasoning,
    messages to ``functions.NAME`` the tool calls. Unless ``final``, a tool call still being written is left out.
    With ``final``, a header never closed (a malformed reply) is returned as content, so no generated text is
    silently lost."""
    messages, pending = parse_reply(ids, tokens, decode)
    reply = Reply()
    content, reasoning = [], []
    for m in messages:
        if m.recipient and m.recipient != "assistant":
            if m.done or final:
                name = m.recipient.removeprefix("functions.")
                reply.tool_calls.append(ToolCall(name, decode(m.ids)))
        elif m.channel == "analysis":
            reasoning.append(decode(m.ids))
        else:
            content.append(decode(m.ids))
    if final and pending:
        content.append(decode(pending))
    reply.content, reply.reasoning = "".join(content), "".join(reasoning)
    return reply
