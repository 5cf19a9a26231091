"""Guided decoding: replies held to a grammar (OpenAI's ``response_format`` JSON modes), token by token.

llguidance (Microsoft's grammar engine, also a vLLM and SGLang backend) computes, after each token, which tokens
may come next; the engine's sampler sets every other logit to -inf before choosing (greedy or sampled), so the
reply is the model's most likely text within the grammar. The token set is built once per tokenizer (about a
second for a 150k vocabulary); each sequence gets its own :class:`Guide`.

A reply whose prompt opened ``<think>`` reasons freely first: its guide starts after the ``</think>`` token, so
thinking models keep their reasoning and write their answer in the grammar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

# JSON as ``json.dumps`` writes it: free whitespace lets a model loop on spaces until its token limit
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response format moeflow cannot turn into a grammar (a 400 naming ``response_format``)."""


def response_format_grammar(response_format: dict[str, Any]) -> str | None:
    """OpenAI's ``response_format`` -> an llguidance grammar (None: plain text). ``json_object``: any JSON object;
    ``json_schema``: ``{"json_schema": {"name": ..., "schema": {...}}}`` held to the schema."""
    import llguidance

    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        schema = spec.get("schema", {})
    else:
        raise GrammarError(f"response_format type {kind!r} is unknown: use 'text', 'json_object' or 'json_schema'")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_LAYOUT)
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"response_format's JSON schema: {e}") from e
    problem = llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"response_format's JSON schema: {problem}")
    return grammar


def lark_grammar(lark: str, what: str) -> str:
    """A grammar in llguidance's lark (``%json {...}`` inline), checked; GrammarError naming ``what``."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"{what}: {e}") from e
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"{what}: {problem}")
    return grammar


class Guide:
    """One sequence's grammar state: :meth:`allowed` before a token is chosen, :meth:`advance` after.

    ``start_after``: a token id (``</think>``) before which the reply is free; ``stop_ids``: the end-of-turn
    tokens, allowed once the grammar accepts (and the only ones once it is complete)."""

    def __init__(self, matcher, vocab_size: int, stop_ids: tuple[int, ...], start_after: int | None = None) -> None:
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, list(stop_ids)
        self.active = start_after is None
        self.start_after = start_after

    def allowed(self) -> torch.Tensor | None:
        """bool [V]: the tokens the grammar allows next (None: not active yet, every token)."""
        if not self.active:
            return None
        if self.matcher.is_stopped():
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        else:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            mask = torch.from_numpy(bits[: self.vocab_size].astype(bool))
            if mask.numel() < self.vocab_size:  # rows past the tokenizer's vocabulary (padded embeddings)
                mask = torch.cat([mask, torch.zeros(self.vocab_size - mask.numel(), dtype=torch.bool)])
        if self.matcher.is_accepting() or self.matcher.is_stopped():
            mask[self.stop_ids] = True
        return mask

    def advance(self, token: int) -> None:
        if not self.active:
            self.active = token == self.start_after
            return
        if token in self.stop_ids:
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token} it had allowed: {self.matcher.get_error()}")


class GuideFactory:
    """The token set of one tokenizer (``tokenizer.json``) for llguidance, built once; :meth:`guide` per request."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(Path(tokenizer_json).read_text(encoding="utf-8"),
                                                eos_token=list(eos_ids) or None)

    def guide(self, grammar: str, stop_ids: tuple[int, ...], start_after: int | None = None) -> Guide:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"response_format: {matcher.get_error()}")
        return Guide(matcher, self.vocab_size, stop_ids, start_after)
