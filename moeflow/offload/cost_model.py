"""Where a missed expert is cheapest: copied to the device, computed on the CPU, or both (first finisher wins).

Per layer, for the experts that are not resident, with the rates of :class:`Rates`:

* copy: the expert's bytes / the host->device rate, *behind* what the copy engine still has to move
  (the backlog: queued high-priority chunks, and the copies chosen earlier in the same plan);
* CPU: ``cpu_expert_s + max(0, tokens - cpu_free_tokens) * cpu_token_s`` behind the CPU work already planned
  on the least busy worker, after the CPU jobs of earlier layers still running (races the copy won after the
  job started; ``cpu_busy_s``). One token pays the weight read; the compute of the first ``cpu_free_tokens``
  hides under it - 1 for a compute-bound kernel, ~2-3 for moeflow's memory-bound int4 one - and each
  further token adds compute.

The cheaper one is chosen; when the two estimates are within ``race_margin`` of each other both are
started and the backend uses whichever finishes first (a copy the CPU beat is cancelled where chunks of it are
still queued, else it lands and stays cached). Experts
are planned most tokens first: they are the ones the device computes best. Pure function of its
inputs, so the decisions are tested on constructed rates (tests/test_hybrid_units.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Choice(Enum):
    COPY = "copy"
    CPU = "cpu"
    BOTH = "both"


@dataclass(frozen=True)
class Rates:
    """Measured (or configured) speeds for the cost model."""

    h2d_bytes_per_s: float  # host -> device copy rate of one expert region
    cpu_expert_s: float  # one expert, one token, on one CPU worker
    cpu_token_s: float  # each further token of the same expert (past cpu_free_tokens)
    cpu_free_tokens: float = 1.0  # tokens whose compute hides under the one-token cost (the weight read)

    def cpu_time(self, tokens: int) -> float:
        return self.cpu_expert_s + max(0.0, tokens - self.cpu_free_tokens) * self.cpu_token_s

    def copy_time(self, nbytes: float) -> float:
        return nbytes / self.h2d_bytes_per_s

    def as_dict(self) -> dict:
        return {"h2d_bytes_per_s": self.h2d_bytes_per_s, "cpu_expert_s": self.cpu_expert_s,
                "cpu_token_s": self.cpu_token_s, "cpu_free_tokens": self.cpu_free_tokens}


@dataclass(frozen=True)
class Candidate:
    """An expert the layer needs that is not ready on the device."""

    expert: int
    tokens: int
    remaining_bytes: int  # a miss: its size; a load under way: bytes the engine moves before it has landed
    loading: bool = False  # a (prefetch) load is already queued: the choice is only COPY (wait) or BOTH
    keep_on_device: bool = False  # a static placement wants it resident (fiddler's popular experts)


def plan(
    candidates: Sequence[Candidate],
    rates: Rates,
    *,
    mode: str,
    backlog_bytes: int = 0,
    cpu_workers: int = 1,
    race_margin: float = 0.25,
    cpu_busy_s: Sequence[float] = (),
) -> dict[int, Choice]:
    """Choice per candidate expert. ``mode``: "never" (all COPY), "always" (CPU unless kept on the device or
    already loading), "auto" (the cost model above). ``backlog_bytes``: what the copy engine moves before a
    new load would start. ``cpu_busy_s``: seconds each CPU job still running from earlier layers (races the copy
    won: a started job cannot be stopped) has left; they occupy the workers first."""
    if mode not in ("never", "always", "auto"):
        raise ValueError(f"cpu_compute mode {mode!r}: expected 'auto', 'never' or 'always'")
    out: dict[int, Choice] = {}
    copy_end = rates.copy_time(backlog_bytes)
    workers = [0.0] * max(1, cpu_workers)
    for busy in sorted(cpu_busy_s, reverse=True):  # the pool takes them in turn: each on the least busy worker
        w = min(range(len(workers)), key=workers.__getitem__)
        workers[w] += max(0.0, busy)
    for c in sorted(candidates, key=lambda c: (-c.tokens, c.expert)):
        w = min(range(len(workers)), key=workers.__getitem__)
        t_cpu = workers[w] + rates.cpu_time(c.tokens)
        if c.loading:  # queued already: what is ahead of it and its own rest are in remaining_bytes
            t_copy = rates.copy_time(c.remaining_bytes)
        else:
            t_copy = copy_end + rates.copy_time(c.remaining_bytes)
        if mode == "never" or c.keep_on_device:
            choice = Choice.COPY
        elif mode == "always":
            choice = Choice.COPY if c.loading else Choice.CPU  # a prefetch under way is a hit: wait for it
        elif max(t_cpu, t_copy) <= (1.0 + race_margin) * min(t_cpu, t_copy):
            choice = Choice.BOTH
        elif t_cpu < t_copy:
            choice = Choice.BOTH if c.loading else Choice.CPU  # a started load races (cancelled if it loses)
        else:
            choice = Choice.COPY
        if choice is not Choice.CPU and not c.loading:
            copy_end = t_copy
        if choice is not Choice.COPY:
            workers[w] = t_cpu
        out[c.expert] = choice
    return out
