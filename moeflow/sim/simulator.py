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
from moeflow.kernels.formats import expert_format
from moeflow.offload import create_expert_backend, get_policy
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.platform import Platform
from moeflow.offload.policies import registered_policies
from moeflow.offload.policies.mixtral_offloading.runtime import GateSpeculator
from moeflow.offload.stats import Stats
from moeflow.sim.batched import BatchError, batch_passes
from moeflow.sim.disk import sim_disk_for
from moeflow.sim.engine import Interval, SimClock, SimCopyEngine, SimHostStore, SimTransport
from moeflow.sim.hybrid import SimHybridCompute, sim_hybrid_factory
from moeflow.sim.llamacpp import LLAMACPP_POLICY, llamacpp_moe_layer, n_cpu_moe
from moeflow.sim.oracle import OraclePredictor, oracle_policy
from moeflow.sim.passes import Pass, sequence_passes, step_bound_s, step_compute_s, step_info
from moeflow.sim.profile import HardwareProfile
from moeflow.trace import DECODE, PREFILL, Trace

# 16 x 16 fp32 dense expert: 3 KiB, splits evenly into 1, 2, 3, 4, 6 or 12 aligned chunks
SIM_FORMAT = expert_format(16, 16, "dense", torch.float32)
# oracle: perfect prediction + Belady eviction from the trace (an upper bound); llamacpp-n-cpu-moe: llama.cpp's
# own placement and execution (--n-cpu-moe, moeflow/sim/llamacpp.py)
SIM_ONLY_POLICIES = ("oracle", LLAMACPP_POLICY)
CPU_COMPUTE_MODES = ("auto", "always", "never")


class SimulationError(MoeflowError, ValueError):
    """The simulation cannot run as asked (unknown policy, missing routers or hidden states, ...)."""


def known_policies() -> list[str]:
    """Every policy the simulator can run: the registered presets plus the simulator's own (oracle,
    llamacpp-n-cpu-moe)."""
    return [*registered_policies(), *SIM_ONLY_POLICIES]


def check_policy(name: str) -> None:
    """SimulationError naming the known policies when ``name`` is none of them. (Policies that compute on the CPU
    need a profile with a CPU cost: :meth:`HardwareProfile.require_cpu` says so when they run.)"""
    if name in SIM_ONLY_POLICIES:
        return
    try:
        get_policy(name)
    except SchedulingError as e:
        raise SimulationError(f"{e}; the simulator also knows {', '.join(map(repr, SIM_ONLY_POLICIES))}") from None


def policy_label(policy: str, cpu_compute: str | None) -> str:
    """How a result names its run: the policy, with ``+cpu-MODE`` when ``cpu_compute`` is set."""
    return policy if cpu_compute is None else f"{policy}+cpu-{cpu_compute}"


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
    cpu_experts: int = 0  # experts computed on the CPU (hybrid execution, fiddler; llama.cpp: expert-layer calls)
    decode_cpu_experts: int = 0
    cpu_busy_s: float = 0.0  # CPU time charged (lanes busy)
    cpu_races: int = 0  # misses both copied and computed on the CPU (the cost model's BOTH); won by the CPU:
    cpu_race_wins: int = 0
    cpu_race_cancels: int = 0  # of the wins, loads cancelled with chunks still queued (the runtime's same count)
    host_experts: int | None = None  # experts in the host cache (the rest read from disk)
    disk_bytes: int = 0  # read from disk after load (bytes of the profile)
    disk_busy_s: float = 0.0
    decode_generated_tokens: int = 0  # tokens the decode passes produced (plain: one per pass)
    decode_time_s: float = 0.0  # every decode pass, summed
    decode_ready_hit_rate: float | None = None  # decode hits whose bytes had landed at the gate (not in flight)
    gated_prefetches: int = 0  # guesses the prefetch gate turned away (Mechanisms.prefetch_gate)
    batch: int = 1  # sequences per pass (simulate(batch=)): tpot_s is then one pass of up to ``batch`` tokens

    @property
    def tokens_per_s(self) -> float | None:
        return 1.0 / self.tpot_s if self.tpot_s else None

    @property
    def time_per_generated_token_s(self) -> float | None:
        """Decode time per token produced while decoding (plain decoding: ``tpot_s``; speculation: its MTP and
        verify passes over the tokens they yielded)."""
        return self.decode_time_s / self.decode_generated_tokens if self.decode_generated_tokens else None

    @property
    def bytes_per_generated_token(self) -> float | None:
        """Host -> device bytes while decoding per token produced while decoding (``Stats``' same ratio)."""
        return self.decode_bytes_h2d / self.decode_generated_tokens if self.decode_generated_tokens else None

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
    cpu_compute: str | None = None,
    cpu_workers: int = 1,
    race_margin: float = 0.25,
    passes: list[list[Pass]] | None = None,
    batch: int = 1,
) -> SimResult:
    """Run ``policy`` with ``slots`` device expert slots over ``trace`` on ``profile``'s hardware.

    gates: the model's routers, for policies that apply them to hidden states (mixtral-offloading).
    timeline_decode_step: which decode pass of the first sequence to draw (default: the middle one).
    host_experts: experts the host cache holds (None: all); the rest are read from the profile's disk.
    early_hits: the GPU's default (``OffloadConfig.early_hits``): a layer's experts in slots are computed while
        the host waits for its routing and schedules; False: the serial schedule (experts after the scheduling).
    predictor_dir: the checkpoint directory whose ``predictors/<kind>.pt`` the learned policies load (duoserve,
        promoe, expertflow; ``moeflow train-predictor``), as ``from_pretrained`` finds them.
    cpu_compute / cpu_workers / race_margin: ``OffloadConfig``'s hybrid execution (misses computed on the CPU at
        the profile's CPU cost, decided by the runtime's cost model: :mod:`moeflow.sim.hybrid`); fiddler computes
        on the CPU whatever this says but "never". ``llamacpp-n-cpu-moe`` runs llama.cpp's placement for the budget
        (:mod:`moeflow.sim.llamacpp`).
    passes: the forward passes per sequence, each with its MoE layers, StepInfo and yielded tokens (a recorded
        speculative run, :mod:`moeflow.sim.speculation`); None: the trace's own (:func:`sequence_passes`).
    batch: sequences decoded together (:mod:`moeflow.sim.batched`): each group of ``batch`` sequences prefilled in
        one pass and decoded one pass per step, every pass carrying its rows' tokens (the union of their experts
        per layer) and the StepInfo the engine gives a left-padded batch. Not with ``passes``.
    """
    profile.check_trace(trace.num_layers, trace.num_experts, trace.top_k, f"trace {trace.source}")
    check_policy(policy)
    if cpu_compute is not None and cpu_compute not in CPU_COMPUTE_MODES:
        raise SimulationError(f"cpu_compute={cpu_compute!r}: expected one of {CPU_COMPUTE_MODES} or None")
    if policy in ("resident", LLAMACPP_POLICY) and cpu_compute not in (None, "never"):
        raise SimulationError(f"policy {policy!r} does not take cpu_compute={cpu_compute!r}")
    if policy == LLAMACPP_POLICY:
        profile.require_cpu(f"policy {policy!r}")
    if len(trace) == 0:
        raise SimulationError(f"{trace.source}: the trace holds no tokens")
    if passes is not None and policy in SIM_ONLY_POLICIES:
        raise SimulationError(f"policy {policy!r} replays a trace's own passes; it does not take passes=")
    if batch != 1:
        if passes is not None:
            raise SimulationError(f"batch={batch} builds its own passes; it does not take passes=")
        try:
            trace, passes = batch_passes(trace, batch, max_sequences)
        except BatchError as e:
            raise SimulationError(str(e)) from None
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
    hybrids: list[SimHybridCompute] = []
    n_cpu_layers = 0
    if policy == "resident":
        n_slots = total
    elif policy == LLAMACPP_POLICY:
        n_cpu_layers = n_cpu_moe(slots, L, E)
        n_slots = (L - n_cpu_layers) * E
        notes.append(f"--n-cpu-moe {n_cpu_layers}: the experts of layers 0-{n_cpu_layers - 1} on the CPU"
                     if n_cpu_layers else "--n-cpu-moe 0: every expert on the GPU")
    else:
        policies = registered_policies()
        if policy == "oracle":
            oracle = OraclePredictor(trace, prefetch_distance)
            policies["oracle"] = oracle_policy(oracle)
        config = OffloadConfig(gpu_expert_slots=slots, policy=policy, prefetch_distance=prefetch_distance,
                               copy_chunks=copy_chunks, max_inflight_chunks=max_inflight_chunks,
                               prefill_ring_slots=prefill_ring_slots, transport="sync", pin_memory=False,
                               early_hits=early_hits, cpu_compute=cpu_compute, cpu_workers=cpu_workers,
                               race_margin=race_margin)
        platform = Platform(clock=clock, transport=lambda config, device: transport, copy_engine=SimCopyEngine,
                            host_store=SimHostStore, compute=compute_hook, read_wait=read_wait,
                            hybrid=sim_hybrid_factory(profile, transport, copy_chunks, hybrids))
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
    if slots > n_slots and policy not in ("resident", LLAMACPP_POLICY):
        notes.append(f"{slots} slots capped at the model's {n_slots} experts")

    sequences = passes if passes is not None else sequence_passes(trace, max_sequences)
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
    llama_cpu = {"prefill": [0, 0.0], "decode": [0, 0.0]}  # llama.cpp: experts computed on the CPU, CPU seconds
    llama_gpu = {"prefill": [0, 0], "decode": [0, 0]}  # llama.cpp: experts on the GPU, experts needed
    llama_bytes = {"prefill": 0, "decode": 0}  # llama.cpp: weights its op offload copies (prefill)
    compute_alone: list[float] = []
    bounds: list[float] = []  # per decode step: compute alone with the host's scheduling (step_bound_s)
    prefill_tokens = decode_generated = 0
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
                for target, experts in step.prefetch:  # queued by the engine before the pass (mtp_prefetch)
                    backend.prefetch(target, list(experts))
                backend.begin_step(step.info if step.info is not None else
                                   step_info(trace, step.rows, steps[0].rows.start, phase))
            for l in (range(L) if step.layers is None else step.layers):
                topk = trace.topk_ids[step.rows, l]
                counts_now = torch.bincount(topk.reshape(-1).long(), minlength=E).tolist()
                transport.compute(profile.attn_s(T), "attention", f"L{l}")
                if policy == LLAMACPP_POLICY:  # llama.cpp: no scheduler; CPU layers wait for the GPU and back
                    cpu_s, moved = llamacpp_moe_layer(transport, clock, profile, l, counts_now, T, l < n_cpu_layers)
                    llama_bytes[phase] += moved
                    used = sum(1 for n in counts_now if n)
                    llama_cpu[phase][0] += used if cpu_s > 0 else 0
                    llama_cpu[phase][1] += cpu_s
                    llama_gpu[phase][0] += used if l >= n_cpu_layers else 0
                    llama_gpu[phase][1] += used
                    continue
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
                decode_generated += step.yields
                compute_alone.append(step_compute_s(trace, profile, step.rows, step.layers))
                if backend is not None:  # (llama.cpp and resident: the bound is compute alone)
                    bounds.append(step_bound_s(trace, profile, step.rows, profile.sched_s, backend.early_hits,
                                               step.layers))
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
    hits = (stats.hit_rate, pre.hit_rate, dec.hit_rate) if backend is not None else (1.0, 1.0, 1.0)
    if policy == LLAMACPP_POLICY:  # the share of needed experts whose weights are on the GPU
        share = (lambda g, n: g / n if n else 1.0)  # noqa: E731
        both = [a + b for a, b in zip(llama_gpu["prefill"], llama_gpu["decode"], strict=True)]
        hits = (share(*both), share(*llama_gpu["prefill"]), share(*llama_gpu["decode"]))
    return SimResult(
        policy=policy_label(policy, cpu_compute), slots=n_slots, total_experts=total, profile=profile.name,
        sequences=len(sequences),
        prefill_tokens=prefill_tokens, decode_steps=len(decode_times), ttft_s=mean(ttfts), tpot_s=mean(decode_times),
        decode_compute_s=compute_mean, decode_bound_s=bound,
        hit_rate=hits[0], prefill_hit_rate=hits[1], decode_hit_rate=hits[2],
        decode_ready_hit_rate=dec.ready_hit_rate if backend is not None else None,
        gated_prefetches=pre.gated_prefetches + dec.gated_prefetches,
        bytes_h2d=int(round((pre.bytes_h2d + dec.bytes_h2d) * scale)) + sum(llama_bytes.values()),
        prefill_bytes_h2d=int(round(pre.bytes_h2d * scale)) + llama_bytes["prefill"],
        decode_bytes_h2d=int(round(dec.bytes_h2d * scale)) + llama_bytes["decode"],
        prefill_stall_s=stall["prefill"], decode_stall_s=stall["decode"],
        prefetches=pre.prefetches + dec.prefetches, useful_prefetches=pre.useful_prefetches + dec.useful_prefetches,
        wasted_prefetches=pre.wasted_prefetches + dec.wasted_prefetches, copy_busy_s=transport.copy_busy_s,
        step_times_s=step_times, timeline_prefill=timelines["prefill"], timeline_decode=timelines["decode"],
        notes=notes, cpu_experts=pre.cpu_experts + dec.cpu_experts + llama_cpu["prefill"][0] + llama_cpu["decode"][0],
        decode_cpu_experts=dec.cpu_experts + llama_cpu["decode"][0],
        cpu_races=pre.cpu_races + dec.cpu_races, cpu_race_wins=pre.cpu_race_wins + dec.cpu_race_wins,
        cpu_race_cancels=pre.cpu_race_cancels + dec.cpu_race_cancels,
        cpu_busy_s=sum(h.busy_s for h in hybrids) + llama_cpu["prefill"][1] + llama_cpu["decode"][1],
        host_experts=host_experts if transport.disk is not None else total,
        disk_bytes=transport.disk.bytes_read if transport.disk is not None else 0,
        disk_busy_s=transport.disk.busy_s if transport.disk is not None else 0.0,
        decode_generated_tokens=decode_generated, decode_time_s=sum(decode_times), batch=batch,
    )


def relative_error(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30) if math.isfinite(a) and math.isfinite(b) else math.inf
