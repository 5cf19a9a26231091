"""Replay a routing trace through the real scheduler on virtual time.

For each sequence of the trace: one prefill forward pass over its prompt rows, then one decode pass per
decode row; in each pass, layer by layer:

1. the non-MoE part of the layer (norms, attention, router) is enqueued on the compute stream;
2. the host waits for the router (the backend's one device->host sync per layer) and spends the
   profile's scheduling time;
3. ``OffloadedExperts.forward`` runs unchanged with the trace's routing: acquire, preemption, prefetch,
   reordered inference. Its copies go to :class:`~moeflow.sim.engine.SimTransport` and its expert compute
   to the compute hook, which charges the profile's expert time for the tokens routed to each expert.

After the last layer the head runs and the host waits for the token. ``resident`` is run the way the
model runs it (``ResidentExperts``: no scheduler, no per-layer sync), so it is compute alone.

The expert regions the real host store and slot pool hold are tiny (``SIM_FORMAT``); each copied chunk is
charged its share of the profile's expert size, and the bytes in the stats are scaled the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.errors import MoeflowError, SchedulingError
from moeflow.kernels.pool import ExpertFormat
from moeflow.offload import create_expert_backend, get_policy
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.eviction import LRU, PriorityEviction
from moeflow.offload.platform import Platform
from moeflow.offload.policies import PolicySpec, registered_policies
from moeflow.offload.predictors.gate_speculator import GateSpeculator
from moeflow.offload.predictors.interface import Predictor
from moeflow.offload.stats import Stats
from moeflow.sim.disk import sim_disk_for
from moeflow.sim.engine import Interval, SimClock, SimCopyEngine, SimHostStore, SimTransport
from moeflow.sim.passes import sequence_passes, step_bound_s, step_compute_s, step_info
from moeflow.sim.profile import HardwareProfile
from moeflow.trace import DECODE, PREFILL, Trace

# 16 x 16 fp32 dense expert: 3 KiB, splits evenly into 1, 2, 3, 4, 6 or 12 aligned chunks
SIM_FORMAT = ExpertFormat(16, 16, "dense", torch.float32)
SIM_ONLY_POLICIES = ("oracle",)  # perfect prediction + Belady eviction from the trace (an upper bound)


class SimulationError(MoeflowError, ValueError):
    """The simulation cannot run as asked (unknown policy, missing routers or hidden states, ...)."""


def known_policies() -> list[str]:
    """Every policy the simulator can run: the registered presets plus the simulator's own ('oracle')."""
    return [*registered_policies(), *SIM_ONLY_POLICIES]


def check_policy(name: str) -> None:
    """SimulationError naming the known policies when ``name`` is none of them, or when the simulator cannot
    model it (policies that compute experts on the CPU: hybrid execution has no cost in the profiles yet)."""
    if name in SIM_ONLY_POLICIES:
        return
    try:
        spec = get_policy(name)
    except SchedulingError as e:
        raise SimulationError(f"{e}; the simulator also knows {', '.join(map(repr, SIM_ONLY_POLICIES))}") from None
    if getattr(spec, "cpu_compute", None) not in (None, "never"):
        raise SimulationError(f"policy {name!r} computes experts on the CPU (hybrid execution), which the simulator "
                              "does not model yet: its profiles have no CPU compute cost")


# ----------------------------------------------------------------------------------------- predictors
class OraclePredictor(Predictor):
    """Perfect foresight, the upper bound of prediction (not a real predictor).

    * ``propose``: at layer l, the experts the trace routes at layer l + distance of this forward pass (past
      the last layer: of the sequence's next pass), most used first;
    * ``score``: Belady's eviction for ``PriorityEviction``: the expert whose next use is farthest goes first.
    """

    def __init__(self, trace: Trace, distance: int = 1) -> None:
        self.trace = trace
        self.L = trace.num_layers
        self.distance = distance
        self.steps: list[slice] = []
        self.i = 0
        self._next_use: list[list[list[float]]] = []  # [step][layer][expert]: next step index using it

    def set_sequence(self, steps: list[slice]) -> None:
        mask = self.trace.topk_mask()
        inf = float("inf")
        nxt = [[inf] * self.trace.num_experts for _ in range(self.L)]
        table = [nxt]
        for s in range(len(steps) - 1, -1, -1):
            used = mask[steps[s]].any(0).tolist()
            nxt = [[s if used[l][e] else nxt[l][e] for e in range(len(used[l]))] for l in range(self.L)]
            table.append(nxt)
        self._next_use = table[::-1]  # index s: from step s on; index len(steps): never
        self.steps, self.i = steps, 0

    def set_step(self, i: int) -> None:
        self.i = i

    def _ids(self, rows: slice, layer: int) -> torch.Tensor:
        ids = self.trace.topk_ids[rows, layer].reshape(-1).long()
        counts = torch.bincount(ids)
        order = torch.argsort(counts, descending=True, stable=True)
        return order[counts[order] > 0]

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        out = []
        for d in range(1, self.distance + 1):
            target = layer + d
            if target < self.L:
                out.append((target, self._ids(self.steps[self.i], target)))
            elif self.i + 1 < len(self.steps) and target - self.L < layer:
                out.append((target - self.L, self._ids(self.steps[self.i + 1], target - self.L)))
        return out

    def score(self, key: tuple[int, int], layer_now: int) -> float:
        """Minus the layers until ``key`` is used next (lowest, i.e. farthest, is evicted first)."""
        l, e = key
        s = self._next_use[self.i + (0 if l > layer_now else 1)][l][e]
        return -((s - self.i) * self.L + l - layer_now)


def oracle_policy(oracle: OraclePredictor) -> PolicySpec:
    """The simulator-only "oracle" policy: ``oracle``'s proposals, Belady eviction over LRU."""
    return PolicySpec("oracle", "perfect prediction and Belady eviction from the trace (an upper bound)",
                      predictor=lambda ctx: oracle, eviction=lambda ctx: PriorityEviction(LRU(), oracle.score))


def load_gates(path: str | Path, num_layers: int) -> list[nn.Linear]:
    """The routers of ``num_layers`` layers: from a safetensors file written by
    :func:`moeflow.trace.synthetic.save_gates` (``routers.{l}.weight``), or from a checkpoint directory (read by
    the model side, :func:`moeflow.engine.loading.read_routers`, which knows the family's weight names)."""
    from safetensors import safe_open

    from moeflow.trace.synthetic import ROUTER_KEY, gate_modules

    path = Path(path)
    if path.is_dir():
        from moeflow.engine.loading import read_routers

        try:
            weights = read_routers(path)[0]
        except (OSError, ValueError) as e:
            raise SimulationError(f"cannot read the routers of checkpoint {path}: {e}") from e
        if len(weights) != num_layers:
            raise SimulationError(f"{path}: {len(weights)} routers for a trace of {num_layers} layers")
        return gate_modules(weights)
    if not path.is_file():
        raise SimulationError(f"no safetensors file with the routers at {path}")
    with safe_open(str(path), "pt") as sf:
        keys = set(sf.keys())
        missing = [l for l in range(num_layers) if ROUTER_KEY.format(l=l) not in keys]
        if missing:
            raise SimulationError(f"{path}: router weights of layers {missing} not found ({ROUTER_KEY})")
        return gate_modules([sf.get_tensor(ROUTER_KEY.format(l=l)).float() for l in range(num_layers)])


# ----------------------------------------------------------------------------------------- results
@dataclass
class SimResult:
    """What one policy did on one trace, profile and slot budget (times in seconds, bytes of the profile)."""

    policy: str
    slots: int
    total_experts: int
    profile: str
    sequences: int
    prefill_tokens: int
    decode_steps: int
    ttft_s: float | None  # mean over sequences: prefill pass until the first token is on the host
    tpot_s: float | None  # mean decode pass time
    decode_compute_s: float | None  # mean decode pass with compute alone (the same routing, every expert resident)
    decode_bound_s: float | None  # compute alone plus the offloaded runtime's per-layer host time
    hit_rate: float
    prefill_hit_rate: float
    decode_hit_rate: float
    bytes_h2d: int
    prefill_bytes_h2d: int
    decode_bytes_h2d: int
    prefill_stall_s: float  # compute stream idle, waiting for copies
    decode_stall_s: float
    prefetches: int
    useful_prefetches: int
    wasted_prefetches: int
    copy_busy_s: float
    step_times_s: list[float] = field(default_factory=list, repr=False)
    timeline_prefill: list[Interval] = field(default_factory=list, repr=False)
    timeline_decode: list[Interval] = field(default_factory=list, repr=False)
    notes: list[str] = field(default_factory=list)
    host_experts: int | None = None  # experts in the host cache (the rest read from disk)
    disk_bytes: int = 0  # read from disk after load (bytes of the profile)
    disk_busy_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return 1.0 / self.tpot_s if self.tpot_s else None

    def as_dict(self, timelines: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("step_times_s")
        if not timelines:
            d.pop("timeline_prefill")
            d.pop("timeline_decode")
        return d


# ----------------------------------------------------------------------------------------- the driver
def simulate(
    trace: Trace,
    policy: str,
    slots: int,
    profile: HardwareProfile,
    *,
    copy_chunks: int = 3,
    max_inflight_chunks: int = 2,
    prefetch_distance: int = 1,
    prefill_ring_slots: int = 2,
    gates: Sequence[nn.Module] | None = None,
    max_sequences: int | None = None,
    timeline: bool = True,
    timeline_decode_step: int | None = None,
    host_experts: int | None = None,
    early_hits: bool = True,
    predictor_dir: str | Path | None = None,
) -> SimResult:
    """Run ``policy`` with ``slots`` device expert slots over ``trace`` on ``profile``'s hardware.

    gates: the model's routers, for policies that apply them to hidden states (mixtral-offloading).
    timeline_decode_step: which decode pass of the first sequence to draw (default: the middle one).
    host_experts: experts the host cache holds (None: all); the rest are read from the profile's disk.
    early_hits: the GPU's default (``OffloadConfig.early_hits``): a layer's experts in slots are computed while
        the host waits for its routing and schedules; False: the serial schedule (experts after the scheduling).
    predictor_dir: the checkpoint directory whose ``predictors/<kind>.pt`` the learned policies load (duoserve,
        promoe, expertflow; ``moeflow train-predictor``), as ``from_pretrained`` finds them.
    """
    profile.check_trace(trace.num_layers, trace.num_experts, trace.top_k, f"trace {trace.source}")
    check_policy(policy)
    if len(trace) == 0:
        raise SimulationError(f"{trace.source}: the trace holds no tokens")
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    total = L * E
    clock = SimClock()
    transport = SimTransport(clock, bandwidth_bps=profile.bandwidth_bps, latency_s=profile.h2d_latency_us * 1e-6,
                             scale=profile.expert_bytes / SIM_FORMAT.nbytes, region_bytes=SIM_FORMAT.nbytes,
                             num_experts=E)
    transport.disk = sim_disk_for(profile, host_experts, L, E)
    stats = Stats()
    notes: list[str] = []
    backend: OffloadedExperts | None = None
    counts_now: list[int] = []

    def compute_hook(layer: int, topk_ids: torch.Tensor, experts: list[int]) -> None:
        experts = [e for e in experts if counts_now[e]]  # an early group names unrouted experts too
        if experts:
            seconds = sum(profile.expert_s(counts_now[e]) for e in experts)
            transport.compute(seconds, "expert", f"L{layer} E{','.join(map(str, experts))}")

    router_done = [0.0]  # when the current layer's routing is on the device (its read-back follows at once)

    def read_wait() -> None:  # the backend's one blocking read: the routing reaches the host, which schedules
        clock.advance_to(router_done[0])
        clock.advance_to(clock.now + profile.sched_s)

    oracle: OraclePredictor | None = None
    needs_hidden = False
    if policy == "resident":
        n_slots = total
    else:
        policies = registered_policies()
        if policy == "oracle":
            oracle = OraclePredictor(trace, prefetch_distance)
            policies["oracle"] = oracle_policy(oracle)
        config = OffloadConfig(gpu_expert_slots=slots, policy=policy, prefetch_distance=prefetch_distance,
                               copy_chunks=copy_chunks, max_inflight_chunks=max_inflight_chunks,
                               prefill_ring_slots=prefill_ring_slots, transport="sync", pin_memory=False,
                               early_hits=early_hits)
        platform = Platform(clock=clock, transport=lambda config, device: transport, copy_engine=SimCopyEngine,
                            host_store=SimHostStore, compute=compute_hook, read_wait=read_wait)
        backend = create_expert_backend(
            config, fmt=SIM_FORMAT, num_layers=L, num_experts=E, top_k=k, device="cpu", kernels_backend="torch",
            gates=list(gates) if gates is not None else [], reserved_bytes=0, stats=stats, platform=platform,
            policies=policies, checkpoint_dir=predictor_dir,
        )
        assert isinstance(backend, OffloadedExperts)
        n_slots = backend.n_slots
        pred = backend.predictor
        if isinstance(pred, GateSpeculator):
            if gates is None:
                raise SimulationError(
                    f"policy {policy!r} applies layer l+1's router to layer l's hidden state: give the model's "
                    "routers (--gates CHECKPOINT_DIR or a *.gates.safetensors file)")
            if len(gates) != L:
                raise SimulationError(f"{len(gates)} routers given for a trace of {L} layers")
        needs_hidden = isinstance(pred, GateSpeculator) or getattr(pred, "needs_hidden", False)
        if needs_hidden and trace.hidden is None:
            raise SimulationError(f"policy {policy!r} predicts from the MoE-layer inputs, and trace {trace.source} "
                                  "has no hidden states: record it with `moeflow trace --hidden`")
        backend.finish_loading()  # warm start (not timed: it happens at load time)
        transport.synchronize()
    clock.now = max(clock.now, transport.copy_free, transport.compute_free)
    transport.copy_busy_s = transport.compute_busy_s = transport.stall_s = 0.0
    if transport.disk is not None:
        transport.disk.reset_counters()  # the warm start's reads happen at load time
    if slots > n_slots and policy != "resident":
        notes.append(f"{slots} slots capped at the model's {n_slots} experts")

    sequences = sequence_passes(trace, max_sequences)
    first_decodes = [s for s in sequences[0] if s.phase == DECODE]
    tl_decode = None
    if first_decodes:
        tl_decode = first_decodes[len(first_decodes) // 2 if timeline_decode_step is None
                                  else min(timeline_decode_step, len(first_decodes) - 1)]
    tl_prefill = sequences[0][0] if sequences[0][0].phase == PREFILL else None
    timelines: dict[str, list[Interval]] = {"prefill": [], "decode": []}

    ttfts: list[float] = []
    decode_times: list[float] = []
    step_times: list[float] = []
    stall = {"prefill": 0.0, "decode": 0.0}
    compute_alone: list[float] = []
    bounds: list[float] = []  # per decode step: compute alone with the host's scheduling (step_bound_s)
    prefill_tokens = 0
    for steps in sequences:
        for i, step in enumerate(steps):
            phase = "prefill" if step.phase == PREFILL else "decode"
            stats.set_phase(phase)
            if oracle is not None:
                if i == 0:
                    oracle.set_sequence([st.rows for st in steps])
                oracle.set_step(i)
            record = timeline and step in (tl_prefill, tl_decode)
            transport.record = record
            transport.intervals = []
            start, stall0 = clock.now, transport.stall_s
            T = step.rows.stop - step.rows.start
            if backend is not None:  # the pass's tokens, embeddings and history, as the engine hands them over
                backend.begin_step(step_info(trace, step.rows, steps[0].rows.start, phase))
            for l in range(L):
                topk = trace.topk_ids[step.rows, l]
                counts_now = torch.bincount(topk.reshape(-1).long(), minlength=E).tolist()
                transport.compute(profile.attn_s(T), "attention", f"L{l}")
                if backend is None:  # resident: no scheduler, the host never waits per layer
                    compute_hook(l, topk, [e for e in range(E) if counts_now[e]])
                    continue
                router_done[0] = transport.compute_free  # the backend's read_wait: the sync, then the schedule
                probs = trace.probs[step.rows, l].float()
                weights = probs.gather(1, topk.long())
                weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-9)
                x = trace.hidden[step.rows, l].float() if needs_hidden else torch.zeros(T, 1)
                backend.forward(l, x, probs, topk, weights)
            transport.compute(profile.head_s, "head", "head")
            clock.advance_to(transport.compute_free)  # the token reaches the host
            elapsed = clock.now - start
            step_times.append(elapsed)
            stall[phase] += transport.stall_s - stall0
            ps = stats.current()
            ps.steps += 1
            ps.tokens += T
            ps.time_s += elapsed
            if step.phase == PREFILL:
                prefill_tokens += T
                if i == 0:
                    ttfts.append(elapsed)
            else:
                decode_times.append(elapsed)
                compute_alone.append(step_compute_s(trace, profile, step.rows))
                if backend is not None:
                    bounds.append(step_bound_s(trace, profile, step.rows, profile.sched_s, backend.early_hits))
            if record:
                timelines[phase] = [Interval(iv.lane, iv.kind, iv.start - start, iv.end - start, iv.label)
                                    for iv in transport.intervals]
    transport.record = False
    if backend is not None:
        backend.close()

    scale = profile.expert_bytes / SIM_FORMAT.nbytes
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)  # noqa: E731
    compute_mean = mean(compute_alone)
    bound = mean(bounds) if backend is not None else compute_mean
    pre, dec = stats.prefill, stats.decode
    return SimResult(
        policy=policy, slots=n_slots, total_experts=total, profile=profile.name, sequences=len(sequences),
        prefill_tokens=prefill_tokens, decode_steps=len(decode_times), ttft_s=mean(ttfts), tpot_s=mean(decode_times),
        decode_compute_s=compute_mean, decode_bound_s=bound,
        hit_rate=stats.hit_rate if backend is not None else 1.0,
        prefill_hit_rate=pre.hit_rate if backend is not None else 1.0,
        decode_hit_rate=dec.hit_rate if backend is not None else 1.0,
        bytes_h2d=int(round((pre.bytes_h2d + dec.bytes_h2d) * scale)),
        prefill_bytes_h2d=int(round(pre.bytes_h2d * scale)), decode_bytes_h2d=int(round(dec.bytes_h2d * scale)),
        prefill_stall_s=stall["prefill"], decode_stall_s=stall["decode"],
        prefetches=pre.prefetches + dec.prefetches, useful_prefetches=pre.useful_prefetches + dec.useful_prefetches,
        wasted_prefetches=pre.wasted_prefetches + dec.wasted_prefetches, copy_busy_s=transport.copy_busy_s,
        step_times_s=step_times, timeline_prefill=timelines["prefill"], timeline_decode=timelines["decode"],
        notes=notes, host_experts=host_experts if transport.disk is not None else total,
        disk_bytes=transport.disk.bytes_read if transport.disk is not None else 0,
        disk_busy_s=transport.disk.busy_s if transport.disk is not None else 0.0,
    )


def relative_error(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30) if math.isfinite(a) and math.isfinite(b) else math.inf
