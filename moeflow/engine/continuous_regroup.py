"""ExpertFlow's token scheduler in the serving engine: a decode step's running rows in micro-batches grouped by
routing-path similarity (ExpertFlow §3.3), each micro-batch a pass of its own with its own expert loads.

Without it (the default) a decode step of the continuous-batching engine is one pass over every running row: per MoE
layer it needs the union of their experts. With it the step runs the rows in micro-batches of at most
``micro_batch_size`` (``"auto"``: two, the paper's dual batch: the tokens of two batches regrouped into two balanced
ones), formed from each row's routing path for the token it feeds, predicted before the
step by the policy's routing-path planner (expertflow's PLEC predictor, ``ExpertBackend.path_planner``: scores from
each row's tokens so far, each row's top-k per layer) and grouped by ``scheduler``:

* ``"policy"``: the policy's own scheduler (expertflow: ``Mechanisms.keep_contiguous``, on by default);
* ``"clustering"``: the paper's balanced k-means on Hamming similarity as it comes (§3.3.3);
* ``"clustering-or-contiguous"``: moeflow's variant, the contiguous split where the clustering activates no fewer
  (layer, expert) pairs;
* ``"contiguous"``: balanced micro-batches in row order, no regrouping (the baseline a measurement compares with).

Each micro-batch's pass gets its rows' predicted scores (``StepInfo.path_scores``): the policy plans from them
without predicting again. KV rows, positions and sampling are unchanged: the engine concatenates the micro-batches'
logits back into row order before it samples, so every request's tokens are those of the one-pass step.
``RegroupStats`` counts what the scheduler did (the pairs are of the predicted paths).

Off by default: on the embedded model at batch 8 two regrouped micro-batches need fewer experts each than two in
row order, but move more bytes per token than one pass (docs/papers.md "ExpertFlow's token scheduler in the server").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from moeflow.engine.sequence import Sequence
from moeflow.engine.token_history import TokenHistory
from moeflow.moe.backend import ExpertBackend, RoutingPathPlanner, StepInfo
from moeflow.offload.policies.expertflow.scheduler import activated_pairs, balanced_split, group_by_routing

SCHEDULERS = ("policy", "clustering", "clustering-or-contiguous", "contiguous")


@dataclass
class RegroupStats:
    """What the token scheduler did since the engine started: decode steps split, micro-batch passes, and the
    (layer, expert) pairs the micro-batches' predicted paths activate, as grouped (``pairs``) and as the balanced
    contiguous split would have grouped them (``contiguous_pairs``)."""

    steps: int = 0
    micro_batches: int = 0
    pairs: int = 0
    contiguous_pairs: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DecodeRegrouper:
    """Splits a decode step's rows into micro-batches by their predicted routing paths (see the module docstring).

    planner: the backend's routing-path planner.  micro_batch_size: most rows per micro-batch, or "auto" (two
    micro-batches of ceil(B / 2)).  scheduler: one of :data:`SCHEDULERS`."""

    def __init__(self, planner: RoutingPathPlanner, micro_batch_size: int | str = "auto",
                 scheduler: str = "policy") -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"token scheduler {scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
        if micro_batch_size != "auto" and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                           or micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be 'auto' or an integer >= 1, got {micro_batch_size!r}")
        self.planner, self.micro_batch_size, self.scheduler = planner, micro_batch_size, scheduler
        self.stats = RegroupStats()

    def size_for(self, batch: int) -> int:
        """Most rows per micro-batch for a step of ``batch`` rows (>= batch: one pass)."""
        return -(-batch // 2) if self.micro_batch_size == "auto" else int(self.micro_batch_size)

    def split(self, ids: torch.Tensor, pos: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[list[list[int]], torch.Tensor] | None:
        """ids/pos int64 [B, 1] of a decode step, history (ids int64 [B, S], mask bool [B, S]): every row's tokens
        so far, the fed one included -> (micro-batches as sorted row-index lists in order of their first member,
        each row's predicted scores fp32 [B, L, E]), or None when the step stays one pass (B <= the size)."""
        batch = ids.shape[0]
        size = self.size_for(batch)
        if batch <= size:
            return None
        mask = torch.ones_like(ids, dtype=torch.bool)
        scores = self.planner.step_scores(StepInfo(ids, pos, mask, "decode", history_ids=history[0],
                                                   history_mask=history[1], all_real=True)).float().cpu()
        paths = self.planner.paths_from_scores(scores)
        if self.scheduler == "policy":
            groups = self.planner.group(paths, size)
        elif self.scheduler == "contiguous":
            groups = balanced_split(batch, size)
        else:
            groups = group_by_routing(paths, size, keep_contiguous=self.scheduler == "clustering-or-contiguous")
        s = self.stats
        s.steps += 1
        s.micro_batches += len(groups)
        s.pairs += activated_pairs(paths, groups)
        s.contiguous_pairs += activated_pairs(paths, balanced_split(batch, size))
        return groups, scores


class DecodePasses(Protocol):
    """The engine's side a split decode step uses (``ContinuousEngine``)."""

    history: TokenHistory | None

    def decode_pass(self, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
                    path_scores: torch.Tensor | None = None) -> torch.Tensor: ...


def run_split(engine: DecodePasses, regrouper: DecodeRegrouper, seqs: list[Sequence], ids: torch.Tensor,
              pos: torch.Tensor) -> torch.Tensor | None:
    """A decode step of ``seqs`` (ids/pos int64 [B, 1] on the host) as micro-batches, one engine pass each ->
    logits fp32 [B, 1, V] in ``seqs``' order; None when the step stays one pass (the caller runs it)."""
    if engine.history is None:
        raise ValueError("the token scheduler reads each row's tokens so far: the engine keeps no token history")
    history = engine.history.feed([s.row for s in seqs], ids, pos, torch.ones_like(ids, dtype=torch.bool))
    plan = regrouper.split(ids, pos, history)
    if plan is None:
        return None
    groups, scores = plan
    logits: torch.Tensor | None = None
    for group in groups:
        index = torch.tensor(group, dtype=torch.long)
        out = engine.decode_pass([seqs[i] for i in group], ids[index], pos[index], scores[index])
        if logits is None:
            logits = out.new_empty((len(seqs), *out.shape[1:]))
        logits[index] = out
    return logits


def make_regrouper(backend: ExpertBackend | None, micro_batch_size: int | str | None,
                   scheduler: str = "policy") -> DecodeRegrouper | None:
    """The engine's token scheduler, or None (one pass per decode step). ``micro_batch_size`` None: off; "auto":
    on where the backend's policy plans routing paths (expertflow), two micro-batches; an integer: on, micro-batches
    of at most that many rows, a ValueError naming the policy when it predicts no routing paths."""
    if micro_batch_size is None:
        return None
    planner = backend.path_planner if backend is not None else None
    if planner is None:
        if micro_batch_size == "auto":
            return None
        raise ValueError(f"micro_batch_size={micro_batch_size!r}: the token scheduler groups rows by their predicted "
                         f"routing paths, and {backend!r} predicts none (use the expertflow policy)")
    return DecodeRegrouper(planner, micro_batch_size, scheduler)
