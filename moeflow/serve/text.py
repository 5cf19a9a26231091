"""Generated ids -> the text a client sees: end-of-turn tokens dropped, cut at a stop string, streamed in order;
for chat, split into content, reasoning and tool calls (harmony models, gpt-oss, by channel; others by their
``<think>`` and tool-call markup, :mod:`moeflow.chat.reply_formats`).

A streamed delta never has to be taken back: text that may still turn into a stop string, and a
multi-byte character whose bytes have not all arrived, are held until they are settled.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from moeflow.chat import reply_formats as rf
from moeflow.chat.harmony import HarmonyTokens, harmony_tokens, split_reply
from moeflow.chat.reply_formats import Reply, ToolCall, ToolFormat, Tools


class TextAssembler:
    def __init__(self, decode: Callable[..., str], stop_strings: list[str], stop_ids: set[int]) -> None:
        self.decode, self.stop_strings, self.stop_ids = decode, stop_strings, stop_ids
        self.sent = ""

    def text(self, ids: list[int]) -> str:
        """The reply so far: a final end-of-turn token dropped, everything from the first stop string cut."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self._cut(self.decode(ids))

    def _cut(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def _settled(self, text: str, final: bool) -> str:
        """``text`` less what may still change: a split character, the start of a stop string (none when final)."""
        if final:
            return text
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its other bytes
            text = text.rstrip("\ufffd")
        hold = max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]

    def hits_stop_string(self, ids: list[int]) -> bool:
        """For the engine's stop check after each token: does a stop string end in the latest tokens?

        Only a tail of the ids is decoded (an ordinary token makes at least one byte of text, a character is
        at most 4 bytes), so the check stays cheap on long replies; the text is cut on the full decode.
        """
        if not self.stop_strings:
            return False
        text = self.decode(ids[-(4 * max(len(s) for s in self.stop_strings) + 8):])
        return any(s in text for s in self.stop_strings)

    def delta(self, ids: list[int], final: bool) -> str:
        """The text not yet sent that is settled (everything, when ``final``)."""
        text = self._settled(self.text(ids), final)
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def delta_fields(self, ids: list[int], final: bool) -> dict:
        """:meth:`delta` as a chat chunk's delta fields."""
        delta = self.delta(ids, final)
        return {"content": delta} if delta else {}

    def message(self, ids: list[int]) -> dict:
        """The chat response's assistant message."""
        return {"role": "assistant", "content": self.text(ids)}

    def finish(self, ids: list[int], reason: str) -> str:
        return "length" if reason == "length" else "stop"


class SplitAssembler(TextAssembler):
    """:class:`TextAssembler` for replies split by destination (:meth:`_reply`, by the subclass): stop strings cut
    the content; reasoning streams as it settles, tool calls come whole at the end. Each step splits the whole
    reply again: fine for replies of thousands of tokens."""

    def __init__(self, decode: Callable[..., str], stop_strings: list[str], stop_ids: set[int]) -> None:
        super().__init__(decode, stop_strings, stop_ids)
        self.sent_reasoning = ""

    def reply(self, ids: list[int], final: bool) -> Reply:
        """The reply in ``ids`` by destination (unless ``final``: tool calls left out, unsettled text held)."""
        raise NotImplementedError

    def text(self, ids: list[int]) -> str:
        return self._cut(self.reply(ids, final=True).content)

    def hits_stop_string(self, ids: list[int]) -> bool:
        return bool(self.stop_strings) and any(s in self.reply(ids, final=False).content for s in self.stop_strings)

    def delta_fields(self, ids: list[int], final: bool) -> dict:
        reply = self.reply(ids, final)
        out = {}
        reasoning = reply.reasoning if final else reply.reasoning.rstrip("\ufffd")
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            out["reasoning_content"], self.sent_reasoning = reasoning[len(self.sent_reasoning):], reasoning
        content = self._settled(self._cut(reply.content), final)
        if content.startswith(self.sent) and len(content) > len(self.sent):
            out["content"], self.sent = content[len(self.sent):], content
        if final and reply.tool_calls:
            out["tool_calls"] = _tool_calls(reply.tool_calls, with_index=True)
        return out

    def message(self, ids: list[int]) -> dict:
        reply = self.reply(ids, final=True)
        out = {"role": "assistant", "content": self._cut(reply.content)}
        if reply.reasoning:
            out["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            out["tool_calls"] = _tool_calls(reply.tool_calls)
            out["content"] = out["content"] or None
        return out

    def finish(self, ids: list[int], reason: str) -> str:
        if reason == "length":
            return "length"
        return "tool_calls" if self.reply(ids, final=True).tool_calls else "stop"


class HarmonyAssembler(SplitAssembler):
    """Harmony replies (gpt-oss): the final channel is the content, the analysis channel ``reasoning_content``,
    messages to ``functions.NAME`` tool calls (:mod:`moeflow.chat.harmony`, split on token ids)."""

    def __init__(self, decode: Callable[..., str], stop_strings: list[str], stop_ids: set[int],
                 tokens: HarmonyTokens) -> None:
        super().__init__(decode, stop_strings, stop_ids)
        self.tokens = tokens

    def reply(self, ids: list[int], final: bool) -> Reply:
        return split_reply(ids, self.tokens, self.decode, final=final)


class MarkupAssembler(SplitAssembler):
    """Replies with ``<think>`` reasoning and/or a tool-call markup in their text (``reply_formats.split_text``).

    ``decode`` must keep the markup tags even where the tokenizer marks them special; ``in_reasoning``: the
    prompt ended inside ``<think>``; ``tool``: None when the request gave no tools (or ``tool_choice`` "none");
    ``forced``: the reply is held to tool calls (a forced ``tool_choice``), so it has no content: text outside
    the finished calls is markup (a call the token limit cut, the separator before it) and is dropped."""

    def __init__(self, decode: Callable[..., str], stop_strings: list[str], stop_ids: set[int],
                 tool: ToolFormat | None, tools: Tools, reasoning: bool, in_reasoning: bool,
                 forced: bool = False) -> None:
        super().__init__(decode, stop_strings, stop_ids)
        self.tool, self.tools, self.reasoning, self.in_reasoning = tool, tools, reasoning, in_reasoning
        self.forced = forced

    def reply(self, ids: list[int], final: bool) -> Reply:
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.decode(ids)
        if not final:
            text = text.rstrip("\ufffd")  # a character split across tokens: wait for its other bytes
        reply = rf.split_text(text, self.tool, self.tools, self.reasoning, self.in_reasoning, final=final)
        if self.forced:
            reply.content = ""
        return reply


def _tool_calls(calls: list[ToolCall], with_index: bool = False) -> list[dict]:
    """OpenAI's ``tool_calls`` entries (with ``index`` in stream deltas); ids are fresh per reply."""
    return [{**({"index": i} if with_index else {}), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


class ChatReplies:
    """How this model's chat replies are split (from ``--tool-call-parser`` / ``--reasoning-parser`` and what the
    chat template and vocabulary show): :meth:`assembler` makes each request's assembler."""

    def __init__(self, tokenizer, template_text: str | None, tool_parser: str = "auto",
                 reasoning_parser: str = "auto") -> None:
        self.decode, self.tokenizer, self.template_text = tokenizer.decode, tokenizer, template_text or ""
        self.tool_parser = tool_parser
        self.harmony = harmony_tokens(tokenizer) if template_text is not None else None
        text = template_text or ""
        self.tool = None if self.harmony else rf.tool_format(tool_parser, text)
        think = tokenizer.token_id(rf.THINK_OPEN) is not None and tokenizer.token_id(rf.THINK_CLOSE) is not None
        self.reasoning = self.harmony is None and rf.reasoning_wanted(reasoning_parser, text, think)
        tags = (rf.THINK_OPEN, rf.THINK_CLOSE, *(self.tool.tags() if self.tool else ()))
        # special tokens are dropped from replies as usual, except the markup's own tags (some vocabularies
        # mark them special): the split needs to see them
        hidden = tokenizer.special_token_ids() - {tokenizer.token_id(t) for t in tags}
        self.markup_decode = lambda ids: tokenizer.decode([i for i in ids if i not in hidden],
                                                          skip_special_tokens=False)

    def forced_call_grammar(self, tools: list[dict], tool_choice: str | dict, prompt: str, parallel: bool = True,
                            asked: str | None = None) -> str:
        """The grammar holding a reply to tool calls in this model's markup (``tool_choice`` "required" or named;
        ``parallel``: "required" may write several); Unsupported naming ``tool_choice`` when the model's markup
        cannot be forced, its message quoting ``asked`` (the tool_choice as the client's API wrote it)."""
        from moeflow.chat.guided import GrammarError, lark_grammar
        from moeflow.chat.tool_grammar import FORCEABLE, tag_writer, tool_call_grammar
        from moeflow.serve.protocol import Unsupported

        asked = asked or f"tool_choice {tool_choice!r}"
        if self.harmony is not None:
            raise Unsupported("tool_choice", f"{asked} forces a tool call, which is not supported for harmony "
                                             "(gpt-oss) replies: let the model choose")
        if self.tool is None:
            why = ("the server runs with --tool-call-parser none" if self.tool_parser == "none" else
                   "the model's chat template shows no tool-call markup moeflow knows")
            raise Unsupported("tool_choice", f"{asked} forces a tool call, written in the model's tool-call markup, "
                                             f"but {why}: let the model choose, or start the server with "
                                             f"--tool-call-parser {'|'.join(FORCEABLE)} if the model writes one")
        try:
            lark = tool_call_grammar(self.tool, tools, tool_choice, tag_writer(self.tokenizer),
                                     fenced="```json" in self.template_text, parallel=parallel)
            return lark_grammar(lark, "tool_choice")
        except GrammarError as e:
            raise Unsupported("tool_choice", str(e)) from e

    def assembler(self, stop_strings: list[str], stop_ids: set[int], prompt: str, tools: list[dict] | None,
                  tool_choice: str | dict | None, forced: bool = False) -> TextAssembler:
        """The assembler of one chat request (``prompt``: its rendered text; tool calls split only when the
        request gives ``tools`` and ``tool_choice`` is not "none"; ``forced``: :meth:`forced_call_grammar` holds
        the reply to calls)."""
        if self.harmony is not None:
            return HarmonyAssembler(self.decode, stop_strings, stop_ids, self.harmony)
        tool = self.tool if tools and tool_choice != "none" else None
        if tool is None and not self.reasoning:
            return TextAssembler(self.decode, stop_strings, stop_ids)
        return MarkupAssembler(self.markup_decode, stop_strings, stop_ids, tool, rf.tool_schemas(tools),
                               self.reasoning, self.reasoning and rf.prompt_opens_reasoning(prompt),
                               forced=forced and tool is not None)
