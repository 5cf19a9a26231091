"""Batched replay: B sequences of a trace decoded together, as ``generate`` runs a left-padded batch.

A trace records one sequence at a time. :func:`batch_passes` groups its sequences B at a time (in the trace's
order) and turns each group into the forward passes ``generate(input_ids [B, W], attention_mask)`` runs:

* one prefill pass over every prompt token of the group (the real tokens of the left-padded [B, W] batch, row by
  row: the order the MoE block hands them to the backend, which leaves padding out before routing);
* decode pass t: the t-th decode token of every sequence of the group that has one (a sequence with fewer decode
  rows is a finished row: it still runs in the engine, masked out, so it routes to no expert).

Each pass's rows of the returned trace are contiguous (the trace's rows reordered), so the simulator prices it as
one pass of T = (its real tokens) tokens: per layer the union of their experts, each expert for the tokens routed
to it (``profile.expert_s(count)``), attention at T. Its :class:`StepInfo` is what the engine gives
``begin_step`` for that pass: ids / positions / token mask [B, W] (prefill, left-padded, positions from the mask as
``positions_from_mask`` counts them) or [B, 1] (decode), the embeddings of those tokens (zeros on padding) and each
row's history [B, S] (prompt left-padded, then its generated tokens; column j = cache position j), so per-sequence
predictors (ExpertFlow's paths, FineMoE's semantic search) see each row's own tokens. A decode pass yields one token
per real row: ``SimResult.bytes_per_generated_token`` / ``time_per_generated_token_s`` are per token.
"""

from __future__ import annotations

import torch

from moeflow.errors import MoeflowError
from moeflow.moe.backend import StepInfo
from moeflow.sim.passes import Pass, sequence_passes
from moeflow.trace import DECODE, PREFILL, Trace


class BatchError(MoeflowError, ValueError):
    """A batched replay that cannot be built (batch < 1, a sequence without a prefill)."""


def batch_passes(trace: Trace, batch: int, max_sequences: int | None = None) -> tuple[Trace, list[list[Pass]]]:
    """(``trace``'s rows reordered so every batched pass's rows are contiguous, the passes per group of ``batch``
    sequences) for ``simulate(trace, ..., passes=)``. ``max_sequences``: the first sequences only (None: all)."""
    if batch < 1:
        raise BatchError(f"batch={batch}: expected at least 1 sequence per batch")
    seqs = sequence_passes(trace, max_sequences)
    for steps in seqs:
        if steps[0].phase != PREFILL:
            raise BatchError(f"{trace.source}: sequence {steps[0].seq} has no prefill rows to batch")
    order: list[int] = []
    groups: list[list[Pass]] = []
    for g in range(0, len(seqs), batch):
        group = seqs[g:g + batch]
        prompts = [s[0].rows for s in group]
        decodes = [[p.rows.start for p in s[1:]] for s in group]
        width = max(r.stop - r.start for r in prompts)
        out: list[Pass] = []
        start = len(order)
        for r in prompts:
            order += range(r.start, r.stop)
        out.append(Pass(g // batch, PREFILL, slice(start, len(order)),
                        info=_prefill_info(trace, prompts, width)))
        for t in range(max(map(len, decodes))):
            live = [i for i, d in enumerate(decodes) if t < len(d)]
            start = len(order)
            order += [decodes[i][t] for i in live]
            out.append(Pass(g // batch, DECODE, slice(start, len(order)),
                            info=_decode_info(trace, prompts, decodes, width, t, live), yields=len(live)))
        groups.append(out)
    return trace.rows(torch.tensor(order, dtype=torch.long)), groups


def _embeds(trace: Trace, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """Embeddings [B, S, H] fp32 of the trace rows ``rows`` [B, S] (-1 / mask False: padding, zeros)."""
    if trace.embed is None:
        return None
    out = torch.zeros((*rows.shape, trace.embed.shape[-1]), dtype=torch.float32)
    out[mask] = trace.embed[rows[mask]].float()
    return out


def _history(trace: Trace, prompts: list[slice], decodes: list[list[int]], width: int, upto: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(history ids [B, width + upto], its mask, the trace row of each column or -1): each prompt left-padded to
    ``width``, then the row's first ``upto`` decode tokens (a finished row: its mask False past its last)."""
    B = len(prompts)
    rows = torch.full((B, width + upto), -1, dtype=torch.long)
    for b, (p, d) in enumerate(zip(prompts, decodes, strict=True)):
        n = p.stop - p.start
        rows[b, width - n:width] = torch.arange(p.start, p.stop)
        got = d[:upto]
        if got:
            rows[b, width:width + len(got)] = torch.tensor(got)
    mask = rows >= 0
    ids = torch.zeros(rows.shape, dtype=torch.long)
    ids[mask] = trace.token_ids[rows[mask]].long()
    return ids, mask, rows


def _prefill_info(trace: Trace, prompts: list[slice], width: int) -> StepInfo:
    ids, mask, rows = _history(trace, prompts, [[] for _ in prompts], width, 0)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # engine.generate.positions_from_mask
    return StepInfo(ids, positions, mask, "prefill", None, _embeds(trace, rows, mask), ids, mask,
                    all_real=bool(mask.all()))


def _decode_info(trace: Trace, prompts: list[slice], decodes: list[list[int]], width: int, t: int,
                 live: list[int]) -> StepInfo:
    hist, hmask, hrows = _history(trace, prompts, decodes, width, t + 1)
    B = len(prompts)
    running = torch.zeros((B, 1), dtype=torch.bool)
    running[live] = True
    ids = torch.where(running, hist[:, -1:], torch.zeros_like(hist[:, -1:]))
    positions = torch.tensor([[p.stop - p.start + t] for p in prompts], dtype=torch.long)
    rows = torch.where(running, hrows[:, -1:], torch.full_like(hrows[:, -1:], -1))
    return StepInfo(ids, positions, running, "decode", None, _embeds(trace, rows, running), hist, hmask,
                    all_real=len(live) == B)
