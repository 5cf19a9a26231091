"""The bandwidth-aware prefetch gate (``Mechanisms.prefetch_gate``; beyond the papers, issue 41, docs/papers.md).

Every predictive policy hands its guesses for later layers to :meth:`SlotLoader.prefetch_guesses`; with the gate
on, each guess not cached yet is queued only where its expected benefit pays for the link time it takes:

* **benefit** ``(a * f + b) * t_copy``: the miss stalls the guess saves. ``a`` is the predictor's accuracy at the
  guess's rank, GoodPred-style (ProMoE §4.1's Accuracy, per rank and per phase, counted online: of the guesses of
  rank r for a layer, the share that layer's routing then needed; a (1, 1) prior). ``f`` is the share of the copy
  that can land before the layer that needs it (ProMoE's FetchRate for this one copy): the time until that
  layer's gate (its distance in layers times the measured layer period) less the link time of what the copy
  engine still holds queued (its own accounting: the unissued chunks of every queued load, needed and
  predicted, and the guesses admitted before this one), over the copy's own link time. ``b`` is the share of
  the guesses of that rank that the layer did not need at once but needed within the next ``HORIZON`` passes
  (the prefetched expert stays cached: a later miss saved whole);
* **cost** ``(1 - a - b) * t_copy``: the link time a guess never used takes from the loads queued behind it (and
  the slot it takes from an expert that may be needed again).

A guess is admitted iff ``a * f + b >= 1 - a - b``: with the link idle until the target layer (f = 1) every
guess used at least half the time; with no slack (f = 0) those whose later uses alone pay. The link time is the
platform's: ``OffloadConfig.h2d_gbps``
when given, else the transport's own rate where it knows it (the simulator's, :class:`KnownLinkRate`), else one
measured copy of an expert region (``calibration.measure_h2d``); the layer period is the backend clock's (the
simulator's virtual one). The gate only drops guesses, so the exact-token invariant holds whatever it admits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from moeflow.offload.contracts import LoadQueue

PHASES = ("prefill", "decode")
MAX_RANK = 64  # guesses of rank >= MAX_RANK - 1 share the last accuracy counter
PERIOD_EMA = 0.2  # weight of the newest layer period in the running estimate
HORIZON = 4  # passes over a guess's layer within which a later use of the guessed expert counts (b)


@runtime_checkable
class KnownLinkRate(Protocol):
    """A transport that knows its own host->device rate (the simulator's), in bytes of the host store per second."""

    @property
    def link_bytes_per_s(self) -> float: ...


def queued_bytes(engine: LoadQueue) -> int:
    """Bytes the copy engine still has to issue: the unissued chunks of every queued load, needed and predicted."""
    return sum(hi - lo for t in engine.pending() for lo, hi in t.chunks[t.next_chunk:])


class PrefetchGate:
    """Admission of predicted loads by expected benefit against link time (see the module docstring).

    expert_bytes: one expert region's bytes; num_layers: the layers a guess's distance wraps around; clock:
    seconds (the backend's); link_rate: host->device bytes per second, called once at the first admission (a
    measurement may sit behind it).
    """

    def __init__(self, expert_bytes: int, num_layers: int, clock: Callable[[], float],
                 link_rate: Callable[[], float]) -> None:
        if expert_bytes <= 0 or num_layers <= 0:
            raise ValueError(f"PrefetchGate: expert_bytes={expert_bytes} and num_layers={num_layers} must be > 0")
        self.expert_bytes = expert_bytes
        self.num_layers = num_layers
        self.clock = clock
        self._link_rate = link_rate
        self._rate: float | None = None
        # per phase, per rank: [outcomes, needed at the target's gate, needed later (within HORIZON passes)]
        self.outcomes = {p: [[0, 0, 0] for _ in range(MAX_RANK)] for p in PHASES}
        self.period_s: dict[str, float | None] = dict.fromkeys(PHASES)  # measured layer period (EMA)
        # (layer, expert) -> guesses not settled yet: [best rank, phase, gates of the layer seen since the guess]
        self._pending: dict[tuple[int, int], list[list]] = {}
        self._last: tuple[int, float, str] | None = None  # (layer, clock, phase) at the last gate

    @property
    def rate(self) -> float:
        if self._rate is None:
            rate = float(self._link_rate())
            if not rate > 0:
                raise ValueError(f"PrefetchGate: host->device rate must be > 0 bytes/s, got {rate}")
            self._rate = rate
        return self._rate

    # ------------------------------------------------------------------ what the routing said
    def record(self, target: int, experts: Iterable[int], phase: str) -> None:
        """The predictor guessed ``experts`` (most wanted first) for layer ``target``: their outcomes are counted
        at that layer's gate."""
        for rank, e in enumerate(experts):
            key = (target, e)
            entries = self._pending.setdefault(key, [])
            if entries and entries[-1][2] == 0:  # guessed again before its gate: one guess, its best rank
                entries[-1][0] = min(entries[-1][0], rank, MAX_RANK - 1)
            else:
                entries.append([min(rank, MAX_RANK - 1), phase, 0])

    def layer_gate(self, layer: int, needed: Iterable[int], phase: str) -> None:
        """Layer ``layer``'s routing is known (``needed``: its experts): count the outcomes of the guesses for it
        and measure the layer period (the time since the previous layer's gate in the same pass and phase)."""
        now = self.clock()
        if self._last is not None and self._last[0] == layer - 1 and self._last[2] == phase and now > self._last[1]:
            sample, old = now - self._last[1], self.period_s[phase]
            self.period_s[phase] = sample if old is None else (1 - PERIOD_EMA) * old + PERIOD_EMA * sample
        self._last = (layer, now, phase)
        if not self._pending:
            return
        needed = set(needed)
        for key in [k for k in self._pending if k[0] == layer]:
            hit, left = key[1] in needed, []
            for entry in self._pending.pop(key):
                if hit or entry[2] + 1 >= HORIZON:
                    self._count(entry, now=hit and entry[2] == 0, later=hit and entry[2] > 0)
                else:
                    entry[2] += 1
                    left.append(entry)
            if left:
                self._pending[key] = left

    def _count(self, entry: list, *, now: bool = False, later: bool) -> None:
        counter = self.outcomes[entry[1]][entry[0]]
        counter[0] += 1
        counter[1] += now
        counter[2] += later

    # ------------------------------------------------------------------ the decision
    def accuracy(self, rank: int, phase: str) -> tuple[float, float]:
        """(a, b) at ``rank`` in ``phase`` so far: the shares of the guesses needed at their layer's gate and needed
        only later (within HORIZON passes), with a (1, 1) prior on a."""
        n, now, later = self.outcomes[phase][min(rank, MAX_RANK - 1)]
        return (now + 1) / (n + 2), later / (n + 2)

    def fetch_fraction(self, target: int, layer_now: int, backlog_bytes: int, phase: str) -> float:
        """The share of one expert's copy that lands before layer ``target``'s gate when queued now at layer
        ``layer_now`` behind ``backlog_bytes``; 1 before any layer period was measured."""
        period = self.period_s[phase]
        if period is None:
            return 1.0
        distance = max((target - layer_now) % self.num_layers, 1)  # outside forward, for layer_now itself: one
        slack_s = distance * period - backlog_bytes / self.rate
        return min(max(slack_s * self.rate / self.expert_bytes, 0.0), 1.0)

    def admit(self, target: int, rank: int, layer_now: int, backlog_bytes: int, phase: str) -> bool:
        """Whether the guess of ``rank`` for layer ``target`` pays: a x f + b >= 1 - a - b."""
        a, b = self.accuracy(rank, phase)
        return a * self.fetch_fraction(target, layer_now, backlog_bytes, phase) + b >= 1.0 - a - b


def gate_for(enabled: bool, host, transport, device, clock: Callable[[], float], configured_bps: float | None
             ) -> PrefetchGate | None:
    """The gate of a backend whose policy switched it on (``Mechanisms.prefetch_gate``), else None. ``host``: the
    expert host store (its format's bytes, its layers, its first region for a measured rate); ``transport``: the
    backend's (a :class:`KnownLinkRate` gives its rate); ``configured_bps``: ``OffloadConfig.h2d_gbps`` in bytes/s."""
    if not enabled:
        return None

    def link_rate() -> float:
        if configured_bps is not None:
            return configured_bps
        if isinstance(transport, KnownLinkRate):
            return transport.link_bytes_per_s
        import torch

        from moeflow.offload.calibration import measure_h2d

        src = host.region(0, 0)
        return measure_h2d(src, torch.empty_like(src, device=device))

    return PrefetchGate(host.fmt.nbytes, host.num_layers, clock, link_rate)
