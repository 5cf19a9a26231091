"""Prompt lookup drafting in the serving engine (``ContinuousEngine(prompt_lookup=N)``, ``moeflow serve
--prompt-lookup N``): while one greedy sequence decodes alone, a decode pass feeds its last token and up to N tokens
drafted by :func:`moeflow.engine.lookup.find_draft` (what ``generate(prompt_lookup_num_tokens=N)`` drafts), and
keeps the draft's longest prefix that equals the model's argmax plus the model's own next token.

When: exactly one sequence decodes and none prefills in the iteration, and it is plain greedy (no sampling, no
penalty or logit bias, no grammar: every token is the argmax of that position's logits, which one pass gives for
every position). Otherwise, or when the lookup finds no draft, the iteration runs the ordinary decode pass.

The verify pass is a :class:`~moeflow.engine.kv_slots.SlotBatch` of one row, 1 + c tokens at their positions (a
prefill chunk's shape, run as a decode pass), which writes and marks valid all 1 + c keys. Keys of the draft tokens
that were not kept (rejected, or past a stop) are marked invalid again before the sequence goes on or finishes, and
their token-history entries zeroed, so the row holds exactly its fed tokens (``Sequence.fed_tokens``: what the
prefix cache stores) and a later pass never sees them. Tokens go out one by one through the engine's own recording
(stop tokens, stop strings, max_tokens, streaming events: as plain decoding, cut at the same token).

With a compiled decode step (``runner.decode_fn`` neither the eager decoder nor captured graphs) the pass is padded
to one width, 1 + N, with masked tokens (never written, never valid), so torch.compile sees one shape (as
``generate``'s :func:`~moeflow.engine.lookup.verify_width`). Captured graphs do not cover a SlotBatch: the pass runs
eagerly.
Models with linear-attention layers are refused: their recurrent state cannot be rolled back past a rejected draft.
"""

from __future__ import annotations

from typing import Any

import torch

from moeflow.engine.cuda_graphs import CudaGraphDecode
from moeflow.engine.lookup import find_draft
from moeflow.engine.sequence import Sequence


class LookupDrafter:
    """Drafted decode passes of ``engine`` (its model, cache, pass and recording): up to ``num_tokens`` drafted
    tokens from n-grams of up to ``max_ngram`` tokens. Each sequence counts ``draft_tokens`` / ``accepted_tokens``."""

    def __init__(self, engine: Any, num_tokens: int, max_ngram: int) -> None:
        """``engine``: the :class:`~moeflow.engine.continuous.ContinuousEngine` that owns this drafter (not imported
        here: that module imports this one)."""
        for name, value in (("prompt_lookup", num_tokens), ("max_matching_ngram_size", max_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if engine.cache.linear is not None:
            raise ValueError(f"prompt_lookup: {engine.model.family.name} has linear-attention layers, whose recurrent "
                             "state a rejected draft would advance; serve without --prompt-lookup")
        self.engine, self.num_tokens, self.max_ngram = engine, num_tokens, max_ngram
        runner = engine.model.runner
        inner = runner.decode_fn.inner if isinstance(runner.decode_fn, CudaGraphDecode) else runner.decode_fn
        self.width = None if inner is runner.decoder else 1 + num_tokens

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether ``seq``'s tokens are each its logits' argmax, so one pass verifies a draft."""
        return not seq.gen_config.do_sample and not seq.params.adjusts_logits and seq.guide is None

    def step(self, seq: Sequence) -> bool:
        """One drafted decode pass for ``seq``, the only sequence decoding; False (nothing run) when it is not
        eligible or the lookup finds no draft."""
        room = seq.params.max_new_tokens - len(seq.generated)  # tokens it may still produce
        if not self.eligible(seq) or room < 2:
            return False
        tokens = seq.prompt_ids + seq.generated
        draft = find_draft(torch.tensor(tokens, dtype=torch.long), min(self.num_tokens, room - 1), self.max_ngram)
        if not draft:
            return False
        engine, c, n = self.engine, len(draft), len(tokens)  # the last token, at n - 1, is not fed yet
        width = self.width or 1 + c
        ids = torch.zeros((1, width), dtype=torch.long)
        ids[0, : 1 + c] = torch.tensor([tokens[-1], *draft])
        pos = torch.arange(n - 1, n - 1 + width)[None]
        mask = torch.zeros((1, width), dtype=torch.bool)
        mask[0, : 1 + c] = True  # (the padding to a compiled width: masked, never written)
        logits = engine._pass("decode", [seq], ids, pos, mask)[0]  # [width, V]
        greedy = logits[: 1 + c].argmax(dim=-1).tolist()
        kept = 0  # drafts equal to the model's own choice at their position
        while kept < c and greedy[kept] == draft[kept]:
            kept += 1
        reason, emitted = None, 0
        for j in range(kept + 1):
            reason = engine._record(seq, greedy[j], logits[j])
            emitted += 1
            if reason is not None:  # a stop token, stop string or max_tokens inside the draft: cut there
                break
        seq.draft_tokens += c
        seq.accepted_tokens += min(kept, emitted)
        stats = engine.model.stats
        stats.draft_tokens += c
        stats.accepted_tokens += min(kept, emitted)
        self._forget(seq.row, n - 1 + emitted, n + c)
        if reason is not None:
            engine._finish(seq, reason)
        return True

    def _forget(self, row: int, start: int, end: int) -> None:
        """Positions [start, end) of ``row`` hold keys of drafts that were not kept: no longer valid, and their
        token-history entries back to 0 (a row holds exactly its fed tokens)."""
        if start >= end:
            return
        self.engine.cache.valid[row, start:end] = False
        if self.engine.history is not None:
            self.engine.history.ids[row, start:end] = 0
