"""Ordering guards under a scripted transport: each one, removed, fails here every time (tests/scripted_transport.py).

The guards: a copy into a slot waits for the copies and compute listed in its ``after`` (copy engine); a deferred
load of the prefill ring carries its slot's fences (backend); a slot released after compute keeps that compute's
fence, so the next copy into it waits for the read (cache); a cancelled load's copies are handed to the next load
of its slot. The scripted transport defers compute and lands copies at the worst moment its ``after`` allows, and
poisons a slot whenever an order is violated, so the outputs go NaN or wrong and ``transport.hazards`` says why.
"""

from __future__ import annotations

import pytest
import torch
from scripted_transport import ScriptedTransport
from test_scheduling_helpers import AWQ, DENSE, Synthetic

from moeflow import kernels
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.offload import CopyEngine


class OneChunkPerPump(CopyEngine):
    """Issues one chunk per pump: prefetches stay queued (partly issued) until their gate, so preemption drops some."""

    def pump(self, max_chunks: int | None = None) -> int:
        return super().pump(1 if max_chunks is None else max_chunks)


def scripted_backend(synth: Synthetic, transport: ScriptedTransport, *, trickle: bool = False, **config):
    return synth.offloaded(transport_object=transport, copy_engine=OneChunkPerPump if trickle else None, **config)


def run_scripted(synth, expected, mode: str, *, trickle: bool = False, **config):
    """Run the trace under a scripted transport; asserts no hazard and bitwise the resident outputs."""
    transport = ScriptedTransport(mode)
    backend, stats = scripted_backend(synth, transport, trickle=trickle, **config)
    try:
        with transport.deferring_compute(kernels):
            got = synth.run(backend, stats)
            backend.synchronize()
    finally:
        backend.close()
    label = f"{config} mode={mode} trickle={trickle}"
    assert transport.hazards == [], f"{label}: {transport.hazards[:3]}"
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"{label}: layer call {i} differs"
    return backend


NO_INT4 = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")


@pytest.fixture(scope="module", params=["dense", pytest.param("cpu-int4", marks=NO_INT4)])
def synth(request):
    """Dense experts on the torch reference, and AWQ experts in CPU int4 slots (bitwise CpuInt4Experts')."""
    if request.param == "dense":
        s = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=11, steps=6, prefill_tokens=9)
    else:
        s = Synthetic(AWQ, layers=3, experts=6, top_k=2, seed=11, steps=6, prefill_tokens=9, kernels="cpu-int4")
    return s, s.run(s.resident())


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_compute_fence_orders_slot_reuse(synth, mode):
    """Slots are reused inside a layer and across layers: every copy must wait for the queued read of its slot.

    Guards: the copy engine passing ``task.after`` to the transport; ``ExpertCache.release`` keeping the compute
    fence; deferred loads carrying ``take_fences``. "eager" lands each copy the moment its ``after`` allows.
    """
    s, expected = synth
    for policy in ("lru", "ondemand", "mixtral-offloading"):
        for n_slots in (2, 3, 5):
            run_scripted(s, expected, mode, policy=policy, gpu_expert_slots=n_slots)


def test_prefill_ring_loads_wait_for_the_ring_slot_reader(synth):
    """DuoServe's k-slot ring: every deferred load reuses a slot whose expert was just computed (queued)."""
    s, expected = synth
    run_scripted(s, expected, "eager", policy="lru", gpu_expert_slots=3, prefill_ring_slots=2)
    run_scripted(s, expected, "eager", policy="ondemand", gpu_expert_slots=2, prefill_ring_slots=2)


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_cancelled_prefetch_lands_before_its_slot_is_reused(synth, mode):
    """Prefetches still queued at their gate are dropped (chunks issued one per pump, so some are half issued) and
    their slots reloaded; in "late" mode the cancelled copies land only after the new one unless its ``after``
    holds them.

    Guards: ``LoadTask.fences`` / the preemption handing the in-flight copies to ``ExpertCache.drop``, which keeps
    them for the next load of the slot.
    """
    s, expected = synth
    cancelled = 0
    for n_slots in (4, 6, 9):
        backend = run_scripted(s, expected, mode, trickle=True, policy="mixtral-offloading",
                               gpu_expert_slots=n_slots, prefetch_distance=2)
        cancelled += backend.engine.cancelled_chunks
    assert cancelled > 0  # the trace does drop half-issued prefetches: the hazard is exercised


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_reclaimed_prefetch_slot_waits_for_the_cancelled_copy(synth, mode):
    """Every slot holds an in-flight prefetch for the next layer when a layer misses: the backend cancels the
    prefetch farthest ahead and loads into its slot; that load must wait for the cancelled copies (and for the
    queued compute that last read the slot, which the prefetch waited for)."""
    s, expected = synth
    transport = ScriptedTransport(mode)
    backend, stats = scripted_backend(s, transport, policy="lru", gpu_expert_slots=4)
    reclaimed = 0
    real_reclaim = backend.loads.reclaim_prefetch_slot

    def counting_reclaim(layer, key):
        nonlocal reclaimed
        reclaimed += bool(backend.cache.loading_unused())
        return real_reclaim(layer, key)

    backend.loads.reclaim_prefetch_slot = counting_reclaim
    got = []
    try:
        with transport.deferring_compute(kernels):
            for phase, layer, x, probs, ids, w in s.calls():
                stats.set_phase(phase)
                needed = set(ids.flatten().tolist())
                backend.prefetch(layer, [e for e in range(s.E) if e not in needed], layer_now=layer - 1)
                got.append(backend.forward(layer, x, probs, ids, w))
            backend.synchronize()
    finally:
        backend.close()
    assert reclaimed > 0  # the trace exercises the reclaim path
    assert transport.hazards == [], transport.hazards[:3]
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"mode={mode}: layer call {i} differs"


def test_scripted_transport_sees_each_hazard():
    """The transport itself: a copy not ordered after a queued reader, or landing over a newer copy, is poisoned."""
    pool = torch.zeros(2, 8, dtype=torch.uint8)
    src = torch.arange(8, dtype=torch.uint8)

    class Pool:
        buffer = pool

    late = ScriptedTransport("late")
    old = late.copy(pool[0], src + 1)
    new = late.copy(pool[0], src + 2)  # no after: the cancelled `old` may land last
    new.synchronize()
    assert old.query() and late.hazards and torch.all(pool[0] == 0xFF)

    eager = ScriptedTransport("eager")
    queued = []
    eager.queue.append(("call", lambda: queued.append(pool[1].clone()), [(pool[1].data_ptr(), pool[1].data_ptr() + 8)]))
    fence = eager.compute_fence()
    ordered = eager.copy(pool[1], src, after=[fence])
    assert not ordered.query() and not eager.hazards  # waits for the queued read
    fence.synchronize()
    assert ordered.query() and torch.equal(queued[0], torch.zeros(8, dtype=torch.uint8)) and not eager.hazards
    eager.queue.append(("call", lambda: None, [(pool[1].data_ptr(), pool[1].data_ptr() + 8)]))
    eager.copy(pool[1], src)  # not ordered after the queued read: lands under it
    assert eager.hazards and torch.all(pool[1] == 0xFF)
    del Pool
