"""ExpertFlow's dual-batch inference pipeline (§4.2): decode steps micro-batch by micro-batch, with the routing-path
prediction and the token scheduling of the next passes run beside the current one on a side lane.

A decode *round* runs every micro-batch once (each sequence advances one token). With micro-batches
``g_0 .. g_{n-1}`` (n >= 2; two for the paper's dual-batch unit):

* after ``g_i``'s pass its rows' next tokens are sampled at once and their path prediction for the next round
  (``PLECPredictor.step_scores``) is queued on the lane; it runs while ``g_{i+1}`` (or the next round's first
  micro-batch) decodes;
* when ``g_{n-1}``'s pass starts, the token scheduler (``group_by_routing`` on each sequence's newest predicted
  path) is queued behind those predictions: it runs beside that pass and gives the next round's micro-batches,
  which swap roles at the round boundary (KV-cache rows follow their sequences: row views, nothing moves);
* a pass starts with its rows' scores handed to the policy (``StepInfo.path_scores``: PLEC plans from them,
  no prediction on the critical path), and the plan of the pass after it is offered to the policy as soon as
  the lane has it (``PLECState.upcoming``): the next pass's experts are prefetched during this pass (§4.1).

One lag is inherent and kept visible (``PipelineStats.stale_rows``): the rows of a round's last micro-batch get
their next tokens only when that pass ends, so the scheduler sees their previous path, and those of them that
the scheduler puts into the next round's first micro-batch start it with their previous step's scores (their
fresh prediction runs beside that pass; the next round's first micro-batch is the one holding fewest of them).
Tokens are unaffected: the plan only decides prefetches. Rows of any other micro-batch wait for their fresh
scores (exposed time, counted, when the predictor is slower than a pass).

Sampling happens per micro-batch (greedy: the same tokens; with ``do_sample`` the random draws are taken in
micro-batch order, so a seed gives other samples than the whole-batch loop).

The pipeline is the expertflow policy's decode strategy (``PolicySpec.decode``, :mod:`moeflow.moe.decode`):
``generate(micro_batch_size=m)`` asks the policy for it and hands it each decode step; micro-batches, the
prefill's included, are formed by the policy's token scheduler (``RoutingPathPlanner.group``:
``Mechanisms.keep_contiguous`` says whether the paper's clustering is taken as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moeflow.errors import InputError, SchedulingError
from moeflow.moe.backend import ExpertBackend, RoutingPathPlanner, StepInfo
from moeflow.moe.decode import DecodeLoop, RowCache, SideLane


@dataclass
class PipelineStats:
    """What the pipeline did in the last ``generate``; times in seconds."""

    rounds: int = 0
    passes: int = 0
    predict_jobs: int = 0
    lane_busy_s: float = 0.0  # prediction + scheduling work on the lane
    schedule_s: float = 0.0  # of which token scheduling
    exposed_s: float = 0.0  # main thread waiting for the lane (all of lane_busy_s without the overlap)
    fresh_rows: int = 0  # rows starting a pass with scores predicted from their newest token
    stale_rows: int = 0  # rows starting a pass with their previous step's scores (see the module docstring)
    next_pass_prefetches: int = 0  # prefetches for the next pass issued during the current one (§4.1)
    planned_at_start: int = 0  # planned (layer, expert) pairs of the passes
    resident_at_start: int = 0  # of them resident or loading when their pass started

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plec_of(backend: ExpertBackend) -> RoutingPathPlanner:
    """The backend's routing-path planner (ExpertFlow's PLEC), or a SchedulingError naming the policy."""
    planner = backend.path_planner
    if planner is None:
        raise SchedulingError(f"the dual-batch pipeline needs a policy with a routing-path predictor (expertflow); "
                              f"{backend!r} has none")
    return planner


class DualBatchPipeline:
    """Decode rounds of the loop's ``batch`` sequences in micro-batches of its ``micro_batch_size``, side work on its
    lane (a :class:`~moeflow.moe.decode.DecodeStrategy`). ``stats``: None until the first decode round."""

    def __init__(self, loop: DecodeLoop) -> None:
        if loop.micro_batch_size is None:
            raise InputError("the dual-batch pipeline runs micro-batches: give micro_batch_size as well")
        self.loop = loop
        self.runner, self.batch, self.size = loop.runner, loop.batch, loop.micro_batch_size
        self.pred = plec_of(loop.runner.backend)
        self.stats: PipelineStats | None = None

    def regroup(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        """The policy's token scheduler (the prefill's micro-batches)."""
        return self.pred.group(paths, micro_batch_size)

    def _begin(self, n: int) -> None:
        """The first decode round: the lane, the prefill's micro-batches, every row's first prediction."""
        loop = self.loop
        self.lane: SideLane = loop.lane()
        self.groups = [list(g) for g in loop.groups]
        L, E = self.runner.num_moe_layers, self.runner.num_experts
        self.scores = torch.zeros((self.batch, L, E))  # each row's newest scores in hand
        self.jobs: dict[int, tuple[Future, int]] = {}  # row -> (its pending prediction, its index in the job)
        self.schedule: Future | None = None
        self.just_ran: set[int] = set()  # rows of the pass that ended last (their prediction has just started)
        self.stats = PipelineStats()
        state = self.pred.state  # the policy's counters run across calls: keep where they stood
        self._counters0 = (state.next_pass_prefetches, state.planned_at_start, state.resident_at_start)
        self.start(loop.hist[:, :n], loop.hist_mask[:, :n])

    def step(self, tok: torch.Tensor, next_pos: torch.Tensor, n: int, done: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One decode round (:meth:`round`): every row advances one token, finished ones too (their tokens are
        padding and ``pick`` pads them), so every row's token is computed."""
        if self.stats is None:
            self._begin(n)
        loop = self.loop
        try:
            return self.round(tok, next_pos, loop.cache, n, loop.hist, loop.hist_mask, loop.pick), self.batch
        except BaseException:
            self.lane.close()
            raise

    # ------------------------------------------------------------------ side work
    def _predict(self, hist: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hist/mask [b, S] of some rows -> their last token's scores [b, L, E] (runs on the lane)."""
        return self.pred.step_scores(StepInfo(hist[:, -1:], hist[:, -1:], mask[:, -1:], "decode", history_ids=hist,
                                              history_mask=mask))

    def _submit_prediction(self, rows: list[int], hist: torch.Tensor, mask: torch.Tensor) -> None:
        idx = torch.tensor(rows)
        future = self.lane.submit(self._predict, hist[idx].cpu().clone(), mask[idx].cpu().clone())
        for j, r in enumerate(rows):
            self.jobs[r] = (future, j)
        self.stats.predict_jobs += 1

    def _newest(self, row: int, scores: torch.Tensor | None = None, jobs: dict | None = None) -> torch.Tensor:
        """The row's newest scores without waiting: its prediction if done, else what it had."""
        job = (self.jobs if jobs is None else jobs).get(row)
        if job is not None and job[0].done() and job[0].exception() is None:
            return job[0].result()[job[1]]
        return (self.scores if scores is None else scores)[row]

    def _schedule(self, last: list[int], scores: torch.Tensor, jobs: dict) -> list[list[int]]:
        """The next round's micro-batches from every row's newest predicted path (runs on the lane, after the
        predictions queued before it, on copies of the main thread's scores and jobs); the one holding fewest
        rows of ``last`` first."""
        t0 = self.lane.clock()
        scores = torch.stack([self._newest(r, scores, jobs) for r in range(self.batch)])
        groups = self.pred.group(self.pred.paths_from_scores(scores), self.size)
        late = set(last)
        groups.sort(key=lambda g: (sum(r in late for r in g), g[0]))
        self.stats.schedule_s += self.lane.clock() - t0
        return groups

    # ------------------------------------------------------------------ the main thread
    def _take_scores(self, group: list[int], just_ran: set[int]) -> torch.Tensor:
        """Scores [b, L, E] of ``group``'s rows for their pass: fresh (waiting if needed), except rows of the pass
        just ended whose prediction is still running (their previous scores)."""
        for r in group:
            job = self.jobs.get(r)
            if job is None:
                continue
            if r in just_ran and not job[0].done():
                self.stats.stale_rows += 1
                continue
            self.scores[r] = self.lane.wait(job[0])[job[1]]
            del self.jobs[r]
            self.stats.fresh_rows += 1
        return self.scores[group]

    def _plan_of(self, group: list[int]) -> dict[int, list[int]] | None:
        """The plan of ``group``'s next pass if every row's scores are in hand now (never waits)."""
        for r in group:
            job = self.jobs.get(r)
            if job is not None and not job[0].done():
                return None
        return self.pred.plan_from_scores(torch.stack([self._newest(r) for r in group]))

    def _upcoming(self, i: int) -> Callable[[], dict[int, list[int]] | None]:
        """What the policy polls during pass i of the round: the plan of the pass after it (made once)."""
        nxt = self.groups[i + 1] if i + 1 < len(self.groups) else None
        schedule, made = self.schedule, []

        def upcoming() -> dict[int, list[int]] | None:
            if not made:
                group = nxt
                if group is None and schedule is not None and schedule.done() and schedule.exception() is None:
                    group = schedule.result()[0]
                plan = self._plan_of(group) if group is not None else None
                if plan is None:
                    return None
                made.append(plan)
            return made[0]
        return upcoming

    def start(self, hist: torch.Tensor, mask: torch.Tensor) -> None:
        """Queue the first decode round's predictions (hist/mask [B, S]: the tokens so far, prompt + first)."""
        for g in self.groups:
            self._submit_prediction(g, hist, mask)

    def round(self, tok: torch.Tensor, next_pos: torch.Tensor, cache: RowCache, n: int, hist: torch.Tensor,
              hist_mask: torch.Tensor, pick: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One decode round: tok [B] (in ``hist`` column n-1), next_pos [B] -> the next tokens [B], written into
        hist/hist_mask column n. ``pick(logits [b, V], rows [b]) -> ids [b]``."""
        device = tok.device
        state = self.pred.state
        state.upcoming = None
        out = torch.empty_like(tok)
        ones = torch.ones((self.batch, 1), dtype=torch.bool, device=device)
        try:
            for i, group in enumerate(self.groups):
                last = i == len(self.groups) - 1
                if last and self.lane.overlaps and len(self.groups) > 1:  # beside the last pass
                    self.schedule = self.lane.submit(self._schedule, group, self.scores.clone(), dict(self.jobs))
                scores = self._take_scores(group, self.just_ran)
                state.upcoming = self._upcoming(i)
                rows = torch.tensor(group, dtype=torch.long, device=device)
                logits = self.runner.forward_pass(tok[rows, None], next_pos[rows, None], cache.rows(rows),
                                                  torch.tensor([n - 1], device=device), ones[rows], "decode", rows,
                                                  (hist[rows, :n], hist_mask[rows, :n]), path_scores=scores,
                                                  all_real=True)[:, -1]
                out[rows] = pick(logits, rows)
                hist[rows, n], hist_mask[rows, n] = out[rows], True
                self._submit_prediction(group, hist[:, : n + 1], hist_mask[:, : n + 1])
                self.just_ran = set(group)
                self.stats.passes += 1
            if len(self.groups) > 1:
                if self.schedule is None:  # inline lane: after the last pass's prediction
                    self.schedule = self.lane.submit(self._schedule, [], self.scores.clone(), dict(self.jobs))
                self.groups = self.lane.wait(self.schedule)
            self.schedule = None
        finally:
            state.upcoming = None
        self.stats.rounds += 1
        return out

    def close(self) -> None:
        """Let the lane finish (a failed side job re-raises here) and fold the lane's and the policy's counters in."""
        if self.stats is None:  # no decode round ran
            return
        for future, _ in list(self.jobs.values()):
            future.result()
        self.lane.close()
        st, state = self.stats, self.pred.state
        st.lane_busy_s, st.exposed_s = self.lane.busy_s, self.lane.exposed_s
        p0, a0, r0 = self._counters0
        st.next_pass_prefetches = state.next_pass_prefetches - p0
        st.planned_at_start, st.resident_at_start = state.planned_at_start - a0, state.resident_at_start - r0
