"""Hybrid execution on virtual time: the runtime's cost-model decision, the CPU workers as lanes of virtual time.

:class:`SimHybridCompute` is the real :class:`~moeflow.offload.hybrid.HybridCompute` with its worker pool replaced:

* the decision is the runtime's own (:meth:`HybridCompute.decide`, i.e. :func:`moeflow.offload.cost_model.plan`
  on the copy queue's backlog), with the rates the runtime would have measured taken from the profile: the
  host->device rate of one expert in ``copy_chunks`` calls, and the profile's CPU cost per expert
  (:meth:`HardwareProfile.cpu_expert_s`);
* a CPU job submitted at host time t runs on the first free of ``cpu_workers`` lanes (the pool's FIFO queue:
  jobs are submitted most tokens first, as the runtime does) from ``max(t, lane free)`` for the profile's CPU
  time of its tokens;
* ``finish`` blocks the host until the layer's jobs are done (the runtime's ``fut.result()``): the rows go to the
  device after that, so the next work the host enqueues starts no earlier;
* a race (the cost model's BOTH: copy and CPU both started) is settled at the earlier of the two completions,
  exactly where the runtime's poll loop would see it. A CPU job that lost its race keeps its lane busy to its end
  when it had started (the runtime cannot stop a running job); one still queued is cancelled (``Future.cancel``)
  and the jobs queued behind it on its lane move up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.cost_model import Choice, Rates
from moeflow.offload.host_store import HostStore
from moeflow.offload.hybrid import HybridCompute, requested_cpu_compute
from moeflow.offload.stats import PhaseStats
from moeflow.sim.engine import SimClock, SimTransport
from moeflow.sim.profile import HardwareProfile


class SimHybridCompute(HybridCompute):
    """HybridCompute whose CPU jobs take the profile's time on virtual CPU lanes (see the module docstring)."""

    def __init__(self, mode: str, config: Any, host: HostStore, keep_on_device: Callable[[tuple[int, int]], bool],
                 *, profile: HardwareProfile, transport: SimTransport, copy_chunks: int) -> None:
        super().__init__(mode, config, host, keep_on_device)  # the thread pool starts no thread until a submit
        self.profile = profile
        self.transport = transport
        self.clock: SimClock = transport.clock
        self.copy_chunks = copy_chunks
        self.lanes = [0.0] * self.workers  # when each CPU worker is free
        self._ends: dict[int, float] = {}  # expert -> when its CPU job ends (this layer's jobs not yet resolved)
        self._jobs: dict[int, list] = {}  # expert -> [lane, start, end] (this layer)
        self._order: list[list[int]] = [[] for _ in range(self.workers)]  # this layer's jobs per lane, in order
        self._st: PhaseStats | None = None
        self.busy_s = 0.0  # CPU lanes' busy time (all jobs that ran, including lost races)

    def prepare(self, device: torch.device, transport_name: str) -> None:
        """The rates the runtime would measure, from the profile (in the simulator's region bytes)."""
        p = self.profile
        h2d = self.host.fmt.nbytes / p.copy_s(self.copy_chunks)  # one whole expert, its chunks' call costs included
        self.rates = Rates(h2d, p.cpu_expert_s(1), p.cpu_token_ms * 1e-3, p.cpu_free_tokens)
        self.rates_source = f"profile {p.name!r}"

    def start_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    misses: list[int], waiting: list[LoadTask], backlog: list[tuple[LoadTask, int]],
                    st: PhaseStats) -> list[int]:
        """The runtime's plan; each CPU job placed on a lane of virtual time. Returns the CPU-only misses."""
        self._layer, self._ends, self._race, self._jobs, self._st = layer, {}, set(), {}, st
        self._order = [[] for _ in range(self.workers)]
        if not misses and not waiting:
            return []
        counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=self.host.num_experts).tolist()
        choices = self.decide(layer, counts, misses, waiting, backlog)
        now = self.clock.now
        for e in sorted((e for e, c in choices.items() if c is not Choice.COPY), key=lambda e: -counts[e]):
            w = min(range(len(self.lanes)), key=self.lanes.__getitem__)
            start = max(now, self.lanes[w])
            seconds = self.profile.cpu_expert_s(counts[e])
            self.lanes[w] = self._ends[e] = start + seconds
            self._jobs[e] = [w, start, start + seconds]
            self._order[w].append(e)
            self.busy_s += seconds
            st.cpu_s += seconds
            if choices[e] is Choice.BOTH:
                self._race.add(e)
                st.cpu_races += 1
        return [e for e, c in choices.items() if c is Choice.CPU]

    def cpu_busy(self) -> list[float]:
        """What each lane still has to run (lost races that had started; the layer's own jobs are not placed yet)."""
        now = self.clock.now
        return [lane - now for lane in self.lanes if lane > now]

    def _job_done(self, e: int) -> bool:
        return self._ends[e] <= self.clock.now

    def _wait_race(self, task: LoadTask, e: int) -> None:
        """Advance the host to whichever comes first: the CPU job's end or the load's landing."""
        engine, end = self.clock.engine, self._ends[e]
        while not (end <= self.clock.now or task.complete()):
            t = end
            if task.issued:
                t = min(t, max(h.end for h in task.handles))
            elif engine is not None and (ev := engine.next_event()) is not None:
                t = min(t, ev)
            if t <= self.clock.now:  # a chunk completed at this instant: the worker issues the next one now
                engine.pump()
            else:
                self.clock.advance_to(t)

    def _drop_job(self, e: int) -> None:
        """``Future.cancel`` of expert e's job (the device computes it; ``settle`` and ``discard_races`` are the
        runtime's): a queued job is dropped (the ones behind it on its lane move up), a running one runs to its
        end."""
        self._ends.pop(e)
        w, start, end = self._jobs[e]
        if start <= self.clock.now:  # running (or done): it keeps its lane to its end
            self._log(e)
            return
        d = end - start
        order = self._order[w]
        for f in order[order.index(e) + 1:]:
            job = self._jobs[f]
            job[1] -= d
            job[2] -= d
            if f in self._ends:
                self._ends[f] = job[2]
        order.remove(e)
        self.lanes[w] -= d
        self.busy_s -= d
        if self._st is not None:
            self._st.cpu_s -= d

    def _log(self, e: int) -> None:
        _, start, end = self._jobs[e]
        self.transport.log("cpu", "expert", start, end, f"L{self._layer} E{e}")

    def finish(self, out: torch.Tensor, st: PhaseStats) -> None:
        """The host blocks for the layer's remaining CPU jobs (their rows then go to the device)."""
        for e in sorted(self._ends, key=self._ends.__getitem__):
            self._write(e, out, st)
        self._ends, self._race = {}, set()

    def _write(self, e: int, out: torch.Tensor, st: PhaseStats) -> None:
        self.clock.advance_to(self._ends.pop(e))
        self._log(e)
        st.cpu_experts += 1

    def abort(self) -> None:
        self._ends, self._race, self._jobs = {}, set(), {}


def sim_hybrid_factory(profile: HardwareProfile, transport: SimTransport, copy_chunks: int,
                       made: list[SimHybridCompute]) -> Callable[..., SimHybridCompute | None]:
    """``Platform.hybrid`` for the simulator: the runtime's requested mode (``requested_cpu_compute``: fiddler's
    "always", ``cpu_compute``), without the format and kernel checks (the profile stands for the kernels);
    refused when the profile has no CPU cost. The executor built is appended to ``made``."""
    def make(config: Any, spec: Any, fmt: Any, host: HostStore,
             keep_on_device: Callable[[tuple[int, int]], bool]) -> SimHybridCompute | None:
        mode = requested_cpu_compute(config, spec)
        if mode == "never":
            return None
        profile.require_cpu(f"policy {spec.name!r} with cpu_compute={mode!r}")
        cpu = SimHybridCompute(mode, config, host, keep_on_device, profile=profile, transport=transport,
                               copy_chunks=copy_chunks)
        made.append(cpu)
        return cpu
    return make
