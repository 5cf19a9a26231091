"""A trace's forward passes as the simulator replays them, and their closed-form times: compute alone, the
bound with the host's scheduling (serial or beside the hits), and ``ondemand``'s analytic pipeline (the checks
of tests/test_sim.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.moe.backend import StepInfo
from moeflow.sim.profile import HardwareProfile
from moeflow.trace import DECODE, PREFILL, Trace


@dataclass
class Pass:
    """One forward pass of a trace sequence: its phase (PREFILL / DECODE) and its rows of the trace.

    A recorded speculative run (:mod:`moeflow.sim.speculation`) also gives ``layers`` (the MoE layers the pass
    runs, in order: an MTP pass runs only the MTP layer's; None: every layer of the trace), ``info`` (the
    :class:`StepInfo` the engine gave the backend; None: built from the trace) and ``yields`` (the tokens the pass
    produced: a verify pass 1 + its accepted drafts, an MTP pass 0) and ``prefetch`` (the (layer, experts) the engine
    asked the backend to prefetch just before the pass: MTP speculation's draft-informed prefetch)."""

    seq: int
    phase: int
    rows: slice
    layers: tuple[int, ...] | None = None
    info: StepInfo | None = None
    yields: int = 1
    prefetch: tuple[tuple[int, tuple[int, ...]], ...] = ()


def sequence_passes(trace: Trace, max_sequences: int | None) -> list[list[Pass]]:
    """Per sequence: the prefill pass (its prompt rows) then one pass per decode row."""
    seq = trace.seq_id.tolist()
    phase = trace.phase.tolist()
    out: list[list[Pass]] = []
    i, n = 0, len(seq)
    while i < n:
        j = i
        while j < n and seq[j] == seq[i]:
            j += 1
        steps, r = [], i
        while r < j and phase[r] == PREFILL:
            r += 1
        if r > i:
            steps.append(Pass(seq[i], PREFILL, slice(i, r)))
        steps += [Pass(seq[i], DECODE if phase[q] == DECODE else PREFILL, slice(q, q + 1)) for q in range(r, j)]
        out.append(steps)
        i = j
        if max_sequences is not None and len(out) >= max_sequences:
            break
    return out


def step_info(trace: Trace, rows: slice, sequence_start: int, phase: str) -> StepInfo:
    """The :class:`StepInfo` the engine would give the backend for the pass over ``rows`` of a trace sequence that
    starts at row ``sequence_start``: its tokens and positions, the recorded embeddings (None when the trace has
    none), and every token of the sequence up to the pass's last (the path predictors' history)."""
    ids = trace.token_ids[rows].long()[None]
    history = trace.token_ids[sequence_start:rows.stop].long()[None]
    embeds = trace.embed[rows].float()[None] if trace.embed is not None else None
    return StepInfo(ids, trace.pos[rows].long()[None], torch.ones_like(ids, dtype=torch.bool), phase, None, embeds,
                    history, torch.ones_like(history, dtype=torch.bool), all_real=True)


def step_compute_s(trace: Trace, profile: HardwareProfile, rows: slice, layers: Sequence[int] | None = None) -> float:
    """One forward pass with compute alone: per layer attention plus each used expert for its tokens, plus the head."""
    return step_bound_s(trace, profile, rows, 0.0, overlap=False, layers=layers)


def step_bound_s(trace: Trace, profile: HardwareProfile, rows: slice, sched_s: float, overlap: bool,
                 layers: Sequence[int] | None = None) -> float:
    """One forward pass's compute (per layer attention plus each used expert for its tokens, plus the head) with
    the host's scheduling of each layer: after its experts (``overlap`` False: the serial schedule) or beside them
    (early hits: the experts in slots run while the host schedules). ``layers``: the MoE layers the pass runs
    (None: all)."""
    T = rows.stop - rows.start
    total = profile.head_s
    for l in (range(trace.num_layers) if layers is None else layers):
        counts = torch.bincount(trace.topk_ids[rows, l].reshape(-1).long(), minlength=trace.num_experts)
        experts = sum(profile.expert_s(int(c)) for c in counts.tolist() if c)
        total += profile.attn_s(T) + (max(experts, sched_s) if overlap else experts + sched_s)
    return total


def analytic_ondemand_step_s(trace: Trace, profile: HardwareProfile, rows: slice, chunks: int = 3) -> float:
    """``ondemand`` with enough slots for a layer's experts: every expert is loaded after its gate, one after
    another on the copy stream (c each), none before; expert j is computed once it landed and expert j-1
    is done: done_j = max(done_{j-1}, j*c) + e_j. Per layer: attention + host scheduling + that pipeline."""
    T = rows.stop - rows.start
    c = profile.copy_s(chunks)
    total = profile.head_s
    for l in range(trace.num_layers):
        counts = torch.bincount(trace.topk_ids[rows, l].reshape(-1).long(), minlength=trace.num_experts).tolist()
        done = 0.0
        for j, n in enumerate([n for n in counts if n], start=1):
            done = max(done, j * c) + profile.expert_s(n)
        total += profile.attn_s(T) + profile.sched_s + done
    return total


def analytic_placed_step_s(trace: Trace, profile: HardwareProfile, rows: slice, on_device: set[tuple[int, int]],
                           early_hits: bool = True) -> float:
    """A pass whose placement never changes: the experts in ``on_device`` computed on the device, every other routed
    expert on one CPU worker (fiddler once its placement is resident; ``cpu_compute`` when the cost model sends
    every miss to the CPU). Per layer: attention, then the device's experts (hits, h) beside the host's scheduling
    (s) and the CPU's experts one after another (c, starting after the scheduling): max(h, s + c) with early hits,
    s + max(h, c) with the serial schedule."""
    T = rows.stop - rows.start
    total = profile.head_s
    for l in range(trace.num_layers):
        counts = torch.bincount(trace.topk_ids[rows, l].reshape(-1).long(), minlength=trace.num_experts).tolist()
        hits = sum(profile.expert_s(n) for e, n in enumerate(counts) if n and (l, e) in on_device)
        cpu = sum(profile.cpu_expert_s(n) for e, n in enumerate(counts) if n and (l, e) not in on_device)
        s = profile.sched_s
        total += profile.attn_s(T) + (max(hits, s + cpu) if early_hits else s + max(hits, cpu))
    return total
