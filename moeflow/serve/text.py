"""Generated ids -> the text a client sees: end-of-turn tokens dropped, cut at a stop string, streamed in order.

A streamed delta never has to be taken back: text that may still turn into a stop string, and a
multi-byte character whose bytes have not all arrived, are held until they are settled.
"""

from __future__ import annotations

from collections.abc import Callable


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stop_strings: list[str], stop_ids: set[int]) -> None:
        self.decode, self.stop_strings, self.stop_ids = decode, stop_strings, stop_ids
        self.sent = ""

    def text(self, ids: list[int]) -> str:
        """The reply so far: a final end-of-turn token dropped, everything from the first stop string cut."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

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
        text = self.text(ids)
        if not final:
            if text.endswith("\ufffd"):  # a character split across tokens: wait for its other bytes
                text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
