"""Prefix caching for the serving engine: a finished sequence's KV row keeps its keys until the row is needed again,
and a new request whose prompt starts the same way reuses them instead of prefilling them again.

Chat and agent clients resend the whole conversation every turn, and with offloaded experts a prefill streams every
expert of every layer through the GPU: recomputing a prefix the server has just computed is the largest waste in
multi-turn serving. :class:`PrefixCache` remembers, for every idle (released) row whose keys are intact, the token
ids they hold (in position order), least recently used first, and places each new sequence:

* **take**: an idle row all of whose tokens start the prompt (turn 2 of a conversation: turn 1's prompt and reply)
  is handed over as it is; the sequence prefills only the rest of its prompt. No copy, nothing cached is lost.
* **copy**: otherwise the sequence needs a fresh row (an empty free row, else the least recently used idle one);
  when another row, idle or still running, shares at least ``min_tokens`` leading tokens with the prompt (a shared
  system prompt, a conversation that diverges mid-way), those positions' keys are copied into the fresh row, a
  device copy of ``length x bytes per token`` (a 2k-token prefix of Mixtral in fp16: 256 MiB, well under a
  millisecond) where the prefill would stream every expert. Copying rather than cutting the source keeps its
  longer content for its own next turn and lets running rows serve concurrent requests with the same system
  prompt; when the fresh row is the source itself (the least recent idle row), it simply keeps the prefix.

Rows of hybrid models (Qwen3-Next, Qwen3.5: linear attention) hold a recurrent state that reflects every token they
have seen and cannot be rewound to a prefix, so they reuse only a whole idle row (take), never a part of one.

A sequence reuses at most ``len(prompt) - 1`` tokens: its last prompt token is always computed, since its logits
give the first reply token. Positions past the reused prefix are invalid (``SlotKVCache.allocate``'s ``keep``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

from moeflow.engine.kv_slots import SlotKVCache

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are recomputed (a copy and a row's content for too little)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``: a bisection over slice compares
    (C-speed), O(length) in all."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return max(hi, 0)
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Placement:
    """Where a new sequence goes: ``row`` (a free row of the cache), the prompt tokens whose keys it gets
    (``reused``; 0: none) and the row they are copied from (``source``; None: ``row`` holds them already)."""

    row: int
    reused: int = 0
    source: int | None = None


class PrefixCache:
    """The token ids held by the idle rows of ``cache`` (least recently used first), and the placement rule (module
    docstring). Counters: ``lookups`` (placements), ``hits`` (placements that reused a prefix), ``reused_tokens``."""

    def __init__(self, cache: SlotKVCache, min_tokens: int = MIN_PREFIX_TOKENS) -> None:
        self.cache, self.min_tokens = cache, max(1, min_tokens)
        # linear-attention states reflect every token a row has seen: only a whole row is reusable
        self.whole_rows_only = cache.linear is not None
        self._held: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self.lookups = self.hits = self.reused_tokens = 0

    @property
    def rows(self) -> int:
        """Idle rows whose keys are kept."""
        return len(self._held)

    def held(self, row: int) -> list[int] | None:
        """The tokens idle row ``row`` holds, or None."""
        return self._held.get(row)

    def store(self, row: int, tokens: list[int]) -> None:
        """Row ``row``, just released, holds the keys of ``tokens`` (positions [0, len(tokens))): the most recent."""
        self._held.pop(row, None)
        if tokens:
            self._held[row] = tokens

    def forget(self, row: int) -> None:
        """Row ``row``'s keys are no longer those stored (it was handed out, or a pass over it failed)."""
        self._held.pop(row, None)

    def place(self, prompt: list[int], running: Iterable[tuple[int, list[int]]] = ()) -> Placement:
        """Where a sequence of ``prompt`` goes; the cache must have a free row. ``running``: (row, tokens its keys
        hold) of the rows in use, copy sources for the shared prefixes of concurrent requests."""
        if not self.cache.free_rows:
            raise RuntimeError("no free row to place a sequence in")
        limit = len(prompt) - 1  # the last prompt token is always computed: its logits give the first reply token
        best, source, whole = 0, None, False
        for row, tokens in self._held.items():  # least recent first: ties go to the most recent
            n = common_prefix(prompt, tokens, limit)
            full = n == len(tokens)
            if (self.whole_rows_only and not full) or (n, full) < (best, whole):
                continue
            best, source, whole = n, row, full
        if not self.whole_rows_only:
            for row, tokens in running:
                n = common_prefix(prompt, tokens, limit)
                if n > best:
                    best, source, whole = n, row, False
        self.lookups += 1
        if best < self.min_tokens:
            return Placement(self._take(self._fresh()))
        self.hits += 1
        self.reused_tokens += best
        if whole:  # (a whole idle row: take it)
            return Placement(self._take(source), best)
        row = self._take(self._fresh())
        return Placement(row, best, None if row == source else source)

    def _fresh(self) -> int:
        """A row for a sequence that takes no whole row: the lowest empty free row, else the least recent idle."""
        empty = [r for r in self.cache.free_row_ids if r not in self._held]
        return empty[0] if empty else next(iter(self._held))

    def _take(self, row: int) -> int:
        self._held.pop(row, None)
        return row
