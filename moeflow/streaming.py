"""A text streamer for ``generate(streamer=...)`` that prints decoded text as tokens arrive."""

from __future__ import annotations

import sys
from typing import Protocol, TextIO

import torch


def first_sequence(ids: torch.Tensor) -> torch.Tensor:
    """What ``generate`` hands a streamer -> sequence 0's new ids [k]: the prompt [B, T], a step's tokens [B], or
    several tokens of one pass [1, k] (prompt lookup decoding)."""
    return ids.reshape(ids.shape[0], -1)[0] if ids.dim() > 1 else ids[:1]


class Streamer(Protocol):
    """What ``generate(streamer=...)`` calls: ``put`` with the prompt first, then each step's new ids (see
    :func:`first_sequence` for their shapes), ``end`` once generation stops (a ``transformers`` streamer fits)."""

    def put(self, ids: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class TextStreamer:
    """Prints the text of sequence 0 as it is generated (skipping the prompt by default).

    Decodes everything generated so far and prints only the new, complete part, so byte-level tokens
    that split a multi-byte character are held back until the character is whole.
    """

    def __init__(self, tokenizer, skip_prompt: bool = True, stream: TextIO | None = None):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.stream = stream or sys.stdout
        self._ids: list[int] = []
        self._printed = 0
        self._seen_prompt = False
        self.text = ""

    def put(self, ids: torch.Tensor) -> None:
        ids = first_sequence(ids)
        if not self._seen_prompt:
            self._seen_prompt = True
            if self.skip_prompt:
                return
        self._ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        new = text[self._printed:]
        if new:
            self.stream.write(new)
            self.stream.flush()
            self._printed = len(text)
        self.text = text

    def end(self) -> None:
        self._emit(self.tokenizer.decode(self._ids))
        self.stream.write("\n")
        self.stream.flush()
