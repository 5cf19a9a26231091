"""Prompt lookup drafting in the serving engine (``ContinuousEngine(prompt_lookup=N)``, ``moeflow serve
--prompt-lookup N``): while one greedy sequence decodes alone, a decode pass feeds its last token and up to N tokens
drafted by :func:`moeflow.engine.lookup.find_draft` (what ``generate(prompt_lookup_num_tokens=N)`` drafts), and
keeps the draft's longest prefix that equals the model's argmax plus the model's own next token.

When: exactly one sequence decodes and none prefills in the iteration, and it is plain greedy (no sampling, no
penalty or logit bias, no grammar: every token is the argmax of that position's logits, which one pass gives for
every position). Otherwise, or when the lookup finds no draft, the iteration runs the ordinary decode pass.

The verify pass feeds one row 1 + c tokens at their positions (a prefill chunk's shape, run as a decode pass), and
writes and marks valid all 1 + c keys. Keys of the draft tokens that were not kept (rejected, or past a stop) are
marked invalid again before the sequence goes on or finishes, and their token-history entries zeroed, so the row
holds exactly its fed tokens (``Sequence.fed_tokens``: what the prefix cache stores) and a later pass never sees
them. Tokens go out one by one through the engine's own recording
(stop tokens, stop strings, max_tokens, streaming events: as plain decoding, cut at the same token).

Captured decode passes (``ContinuousEngine.graphs``: CUDA graphs) capture the verify pass too: it has one width,
1 + N, a shorter draft followed by fillers (the last token again, at the next positions clamped into the row) whose
logits are never read, and runs on a persistent :class:`~moeflow.engine.slot_verify.SlotVerifyView` of the row per
key-length bucket (:func:`~moeflow.engine.slot_verify.key_bucket`, as the one-token passes), whose step is captured
once and replayed for every later drafted pass in that bucket (``ContinuousEngine.warm_up`` captures the smallest
bucket's, and runs it once per draft length so an offload backend's device part is captured per real-token count
too). A filler's keys are written past the draft but never marked valid, and its token is not fed to the token
history; it reaches no expert where the expert backend runs between the graph's pieces (the offload scheduler): it
is masked out of the pass's real tokens (``StepInfo.real_tokens``), so it moves, counts and predicts nothing. A
backend the capture traces through (every expert resident: one whole graph, which bakes in which tokens it computes)
computes the fillers as real tokens (they move nothing), as ``generate``'s drafted passes
(:mod:`moeflow.engine.lookup`). Without captured passes the pass is a :class:`~moeflow.engine.kv_slots.SlotBatch`
of one row, run eagerly: with a compiled decode step (``runner.decode_fn`` not the eager decoder) padded to the
same width with masked tokens (never written, never valid), so torch.compile sees one shape; with the eager
decoder at its own width 1 + c.
Models with linear-attention layers are refused: their recurrent state cannot be rolled back past a rejected draft.
"""

from __future__ import annotations

import time

import torch

from moeflow.engine.compiled import traces_through
from moeflow.engine.cuda_graphs import CudaGraphDecode
from moeflow.engine.lookup import find_draft
from moeflow.engine.sequence import Sequence
from moeflow.engine.served import DraftHost
from moeflow.engine.slot_verify import SlotVerifyView, key_bucket, verify_view


class LookupDrafter:
    """Drafted decode passes of ``engine`` (its model, cache, pass and recording): up to ``num_tokens`` drafted
    tokens from n-grams of up to ``max_ngram`` tokens. Each sequence counts ``draft_tokens`` / ``accepted_tokens``."""

    def __init__(self, engine: DraftHost, num_tokens: int, max_ngram: int) -> None:
        """``engine``: the :class:`~moeflow.engine.continuous.ContinuousEngine` that owns this drafter (as a
        :class:`~moeflow.engine.served.DraftHost`: that module imports this one)."""
        for name, value in (("prompt_lookup", num_tokens), ("max_matching_ngram_size", max_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if engine.cache.linear is not None:
            raise ValueError(f"prompt_lookup: {engine.model.family.name} has linear-attention layers, whose recurrent "
                             "state a rejected draft would advance; serve without --prompt-lookup")
        self.engine, self.num_tokens, self.max_ngram = engine, num_tokens, max_ngram
        runner = engine.model.runner
        inner = runner.decode_fn.inner if isinstance(runner.decode_fn, CudaGraphDecode) else runner.decode_fn
        self.width = None if inner is runner.decoder else 1 + num_tokens  # of an uncaptured pass
        self.views: dict[int, SlotVerifyView] = {}  # key bucket -> the captured verify passes' view

    @property
    def captured(self) -> bool:
        """Whether drafted passes replay a captured step (the engine's decode passes do)."""
        graphs = self.engine.graphs
        return graphs is not None and graphs.refused is None

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
        captured = self.captured
        width = 1 + self.num_tokens if captured else self.width or 1 + c
        ids, pos, real = verify_inputs(tokens[-1], draft, n - 1, width, engine.cache.max_len)
        if captured:
            logits = self._captured(seq, ids, pos, real)
        else:  # (the padding to a compiled width: masked, never written)
            logits = engine._pass("decode", [seq], ids, pos, real)[0]  # [width, V]
        settle_verified(engine, seq, draft, logits, n)
        return True

    def warm_up(self, seq: Sequence) -> None:
        """Capture the verify step at the smallest key bucket, then replay it once per draft length (an offload
        backend captures its device part per real-token count): passes of token 0 from position 0 of ``seq``'s
        row (a free row the caller, ``ContinuousEngine.warm_up``, clears afterwards)."""
        for c in range(self.num_tokens + 1):
            self._captured(seq, *verify_inputs(0, [0] * c, 0, 1 + self.num_tokens, self.engine.cache.max_len),
                           count=False)

    def _captured(self, seq: Sequence, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor,
                  count: bool = True) -> torch.Tensor:
        """The verify pass on its captured step: ids/pos int64 [1, W], real bool [1, W] (host) -> logits fp32
        [W, V] (the step's static buffer on the CPU: read before its next replay). ``count``: into the stats and
        the listener (not the warm-up's)."""
        engine, runner = self.engine, self.engine.model.runner
        bucket = key_bucket(int(pos.max()) + 1, engine.cache.max_len)
        view = self.views.get(bucket)
        if view is None:
            view = self.views[bucket] = verify_view(engine.cache, ids.shape[1], bucket)
        view.load(torch.tensor([seq.row], dtype=torch.long), real)
        history = engine.history.feed([seq.row], ids, pos, real) if engine.history is not None else None
        fillers_real = traces_through(runner.backend)  # (a whole captured graph bakes in the tokens it computes)
        mask = torch.ones_like(real) if fillers_real else real
        dev = engine.device
        ids, pos, mask = ids.to(dev), pos.to(dev), mask.to(dev)
        engine.model.stats.set_phase("decode")
        start = time.perf_counter()
        logits = runner.forward_pass(ids, pos, view, pos, mask, "decode", rows=view.rows, history=history,
                                     all_real=fillers_real or bool(real.all()))[0].cpu()
        if count:
            engine._count("decode", 1, int(real.sum()), time.perf_counter() - start)
        return logits

def settle_verified(engine: DraftHost, seq: Sequence, draft: list[int], logits: torch.Tensor, n: int) -> None:
    """After a verify pass of ``seq`` (its last token at position ``n - 1``, then ``draft``; ``logits`` [>= 1 + c,
    V]): record the drafts equal to the model's own choice and the model's token after them (cut at a stop token,
    stop string or max_tokens inside the draft), count drafts and accepts, forget the keys of the rest, and finish
    the sequence when a stop was reached."""
    c = len(draft)
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
    forget_drafts(engine, seq.row, n - 1 + emitted, n + c)
    if reason is not None:
        engine._finish(seq, reason)


def forget_drafts(engine: DraftHost, row: int, start: int, end: int) -> None:
    """Positions [start, end) of ``engine``'s ``row`` hold keys of drafts that were not kept: no longer valid, and
    their token-history entries back to 0 (a row holds exactly its fed tokens)."""
    if start >= end:
        return
    engine.cache.valid[row, start:end] = False
    if engine.history is not None:
        engine.history.ids[row, start:end] = 0


def verify_inputs(last: int, draft: list[int], start: int, width: int, max_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify pass's host inputs: ``last`` (the row's last token, at ``start``) then ``draft``, then fillers up to
    ``width`` (``last`` again, at the next positions clamped to ``max_len - 1``: never a real token's, the last of
    which sits at most at max_len - 2) -> ids int64 [1, width], positions int64 [1, width], real bool [1, width]."""
    r = 1 + len(draft)
    ids = torch.full((1, width), last, dtype=torch.long)
    ids[0, :r] = torch.tensor([last, *draft], dtype=torch.long)
    pos = torch.arange(start, start + width).clamp_(max=max_len - 1)[None]
    real = torch.zeros((1, width), dtype=torch.bool)
    real[0, :r] = True
    return ids, pos, real
