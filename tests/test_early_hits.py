"""``OffloadConfig.early_hits``: an offloaded layer's group over the experts already in slots is launched before
the layer's routing is read back (docs/design.md, "Hits launched before the read-back"), so on a GPU the hits are
computed while the host waits and schedules the misses. On by default only where the read-back is a real wait (a
CUDA device); forced on here on the CPU, where every launch runs at once or, under the scripted transport, is
queued and run as late as its fences allow.

What must hold: bitwise the outputs and exactly the schedule (hits, misses, bytes, evictions) of the same policy
without it, for every policy; one blocking read per layer; no copy into a slot the early group may read before
that group ran (the group names every READY slot of its layer, routed or not, and the static torch form reads
them all): caught when the fence is left out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scripted_transport import ScriptedTransport
from test_device_graphs import _scripted_graph_run, synth_uncaptured  # noqa: F401 (a fixture)
from test_fences import run_scripted
from test_scheduling_helpers import AWQ, DENSE, Synthetic

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.offload import POLICY_NAMES
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.cache import ExpertCache

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
POLICIES = [p for p in POLICY_NAMES if p not in ("resident", "fiddler")]
PROMPT = "The \"with\" statement is used to wrap the execution of a block"


@pytest.fixture(scope="module")
def dense():
    s = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=11, steps=6, prefill_tokens=9)
    return s, s.run(s.resident())


def _count_early(monkeypatch) -> list[int]:
    """Spy on the early launches: the number of experts each one covered."""
    sizes: list[int] = []
    launch = OffloadedExperts._launch_early

    def spy(self, layer, x, topk_ids, topk_weights):
        out, early = launch(self, layer, x, topk_ids, topk_weights)
        sizes.append(len(early))
        return out, early
    monkeypatch.setattr(OffloadedExperts, "_launch_early", spy)
    return sizes


def test_off_on_the_cpu_by_default_and_refused_where_a_group_needs_the_host_routing(dense):
    s, _ = dense
    backend, _ = s.offloaded(policy="lru", gpu_expert_slots=4)
    assert backend.early_hits is False  # the CPU's read-back is free: nothing to overlap
    backend.close()
    backend, _ = s.offloaded(policy="lru", gpu_expert_slots=4, early_hits=True)
    assert backend.early_hits is True
    backend.close()
    if int4_cpu_available():
        awq = Synthetic(AWQ, layers=2, experts=4, top_k=2, seed=3, steps=2, prefill_tokens=3, kernels="cpu-int4")
        with pytest.raises(ValueError, match="early_hits=True: kernels='cpu-int4' slots"):
            awq.offloaded(policy="lru", gpu_expert_slots=4, early_hits=True)


def _schedule(stats) -> dict:
    keep = ("hits", "misses", "inflight_hits", "bytes_h2d", "prefetches", "useful_prefetches", "wasted_prefetches",
            "copies", "cpu_experts")
    return {(phase, name): getattr(getattr(stats, phase), name) for phase in ("prefill", "decode") for name in keep
            if hasattr(getattr(stats, phase), name)}


@pytest.mark.parametrize(("policy", "cpu_compute"), [*((p, None) for p in POLICIES), ("lru", "always"),
                                                     ("fiddler", None)])
def test_the_same_tokens_and_the_same_schedule_for_every_policy(policy, cpu_compute, monkeypatch):
    """The embedded model, greedy: tokens, stats and evictions with early hits = without, at two budgets (misses
    computed on the CPU by hybrid execution too: they are the schedule's, the early group only takes hits)."""
    sizes = _count_early(monkeypatch)
    for slots in (8, 20):
        runs = {}
        for early in (False, True):
            m = MoEOffloadedMixtral.from_pretrained(
                MODEL, kernels="torch", offload=OffloadConfig(policy=policy, gpu_expert_slots=slots, early_hits=early,
                                                              cpu_compute=cpu_compute))
            try:
                ids = torch.tensor([m.tokenizer.encode(PROMPT)])
                tokens = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
                runs[early] = (tokens, _schedule(m.stats), m.experts.cache.evictions)
                m.experts.cache.check()
            finally:
                m.close()
        assert torch.equal(runs[True][0], runs[False][0]), (policy, slots)
        assert runs[True][1:] == runs[False][1:], (policy, slots)
    if policy != "ondemand":  # ondemand empties a slot once read: no expert is ever in a slot at a layer's start
        assert sizes and max(sizes) > 0  # the early groups did compute experts


def test_one_blocking_read_per_layer(dense):
    s, expected = dense
    backend, stats = s.offloaded(policy="lru", gpu_expert_slots=5, early_hits=True)
    try:
        reads = []
        got = []
        for phase, layer, x, probs, ids, w in s.calls():
            stats.set_phase(phase)
            before = backend.readback.blocking_reads
            with torch.no_grad():
                got.append(backend.forward(layer, x, probs, ids, w))
            reads.append(backend.readback.blocking_reads - before)
    finally:
        backend.close()
    assert set(reads) == {1}
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_the_fences_hold_with_the_early_group(dense, mode, monkeypatch):
    """Copies landed at the worst moment their fences allow and compute run as late as possible: no hazard and
    bitwise the resident outputs, slots reused within and across layers, prefetches cancelled."""
    s, expected = dense
    sizes = _count_early(monkeypatch)
    for policy in ("lru", "ondemand", "mixtral-offloading"):
        for n_slots in (2, 3, 5):
            run_scripted(s, expected, mode, policy=policy, gpu_expert_slots=n_slots, early_hits=True)
    run_scripted(s, expected, mode, trickle=True, policy="mixtral-offloading", gpu_expert_slots=6,
                 prefetch_distance=2, early_hits=True)
    assert max(sizes) > 0


def test_an_early_group_left_unfenced_is_caught(dense, monkeypatch):
    """Not blind: without the early group's fence a copy overwrites a slot the queued group still reads."""
    s, expected = dense
    monkeypatch.setattr(ExpertCache, "fence", lambda self, slot, fence: None)
    failures = 0
    for policy in ("lru", "mixtral-offloading"):
        for n_slots in (2, 3, 5):
            try:
                run_scripted(s, expected, "late", policy=policy, gpu_expert_slots=n_slots, early_hits=True)
            except AssertionError:
                failures += 1
    assert failures > 0


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_the_captured_device_part_runs_the_early_group(synth_uncaptured, mode):  # noqa: F811
    """The early group replays the same captured piece as any group: no hazard, bitwise the uncaptured run."""
    s, expected = synth_uncaptured
    for policy in ("lru", "ondemand"):
        for n_slots in (2, 5, s.L * s.E):
            transport = ScriptedTransport(mode)
            got, graphs = _scripted_graph_run(s, transport, policy=policy, gpu_expert_slots=n_slots,
                                              early_hits=True)
            label = f"{policy} with {n_slots} slots, mode={mode}"
            assert transport.hazards == [], f"{label}: {transport.hazards[:3]}"
            assert graphs.refused == {} and graphs.replays > len(expected), label
            for i, (a, b) in enumerate(zip(expected, got, strict=True)):
                assert torch.equal(a, b), f"{label}: layer call {i} differs"


def test_captured_decode_tokens(monkeypatch):
    """The CUDA-graph decode step (the recording stand-in) with early hits: greedy tokens = resident."""
    from test_compile_cuda_graphs import captured_model

    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)] * 2)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    ref.close()
    sizes = _count_early(monkeypatch)
    model, graphs = captured_model(OffloadConfig(policy="lru", gpu_expert_slots=14, early_hits=True),
                                   inner=lambda decoder: decoder)
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
        device = model.experts.device_graphs
    finally:
        model.close()
    assert graphs.refused is None and device.refused == {} and device.captures == 1
    assert torch.equal(got, want) and max(sizes) > 0
