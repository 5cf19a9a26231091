"""Batched issue in the copy engine (many small experts, issue 16) and its ordering guards.

A transport with ``copy_batch`` gets several chunks per issue: a layer's needed loads share one handle, chunks
adjacent in the host store and the pool become one copy, a prediction goes one chunk per issue. The scripted
transport below lands each copy of a batch on its own, at the worst moment its fences allow (on a GPU the
copies of a batch land one by one before the batch's event), so a fence of any task in a batch that is not
passed to the transport shows up as a hazard.
"""

from __future__ import annotations

import threading

import pytest
import torch
from scripted_transport import ScriptedHandle, ScriptedTransport
from test_scheduling_helpers import DENSE, Synthetic

from moeflow import kernels
from moeflow.kernels.pool import ExpertPool
from moeflow.offload import CopyEngine, HostStore, Stats, SyncTransport
from moeflow.offload import transport as transport_mod


def _store(layers=2, experts=6):
    store = HostStore(DENSE, layers, experts, pin=False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    store.buffer.copy_(torch.randint(0, 255, store.buffer.shape, generator=gen, dtype=torch.uint8))
    store.loaded.fill_(True)
    return store


def _engine(transport=None, n_slots=8, **kw):
    store = _store()
    pool = ExpertPool.allocate(DENSE, n_slots, "cpu")
    pool.buffer.zero_()
    return CopyEngine(transport or SyncTransport(), store, pool, **kw), store, pool


class CountingSync(SyncTransport):
    """Records every batch handed over: [(dst, src), ...] and its fences."""

    def __init__(self) -> None:
        self.batches: list[tuple[list, tuple]] = []

    def copy_batch(self, pairs, after=()):
        self.batches.append((list(pairs), tuple(after)))
        return super().copy_batch(pairs, after)


def test_needed_loads_of_a_layer_go_as_one_batch_with_adjacent_runs_merged():
    transport = CountingSync()
    engine, store, pool = _engine(transport, chunks=3)
    stats = Stats().current()
    # experts 1, 2 of layer 0 into slots 4, 5: adjacent in the store and in the pool (one copy); expert 4 apart
    tasks = [engine.submit(0, e, s, high=True, stats=stats) for e, s in ((1, 4), (2, 5), (4, 0))]
    assert engine.pump(1) == 1  # one issue took all three (3 x 3 chunks, far under 8 MiB)
    (pairs, _), = transport.batches
    assert [p[0].numel() for p in pairs] == [2 * DENSE.nbytes, DENSE.nbytes]
    assert all(t.issued and t.handles == [tasks[0].handles[0]] for t in tasks)
    assert (engine.tasks, engine.batches, engine.copies) == (3, 1, 2)
    assert (stats.copy_batches, stats.copies, stats.bytes_h2d) == (1, 2, 3 * DENSE.nbytes)
    for t in tasks:
        assert torch.equal(pool.buffer[t.slot], store.region(t.layer, t.expert))


def test_batch_bytes_bound_and_predictions_one_chunk_per_issue():
    transport = CountingSync()
    per_chunk = -(-DENSE.nbytes // 3)
    engine, store, pool = _engine(transport, chunks=3, batch_bytes=4 * per_chunk)
    low = [engine.submit(1, e, e, high=False) for e in range(2)]
    high = [engine.submit(0, e, 4 + e, high=True) for e in range(3)]
    engine.pump()
    sizes = [sum(d.numel() for d, _ in pairs) for pairs, _ in transport.batches]
    # high first: a batch takes the head's chunks, then another task only whole (3 + 0: the second task's 3
    # chunks would pass the bound), so one expert per batch here; then every low chunk alone
    assert sizes == [DENSE.nbytes] * 3 + [hi - lo for _ in low for lo, hi in engine.low_chunks]
    assert all(len(pairs) == 1 for pairs, _ in transport.batches)  # an expert's chunks merged into one copy
    assert [t.complete() for t in (*high, *low)] == [True] * 5
    for t in (*high, *low):
        assert torch.equal(pool.buffer[t.slot], store.region(t.layer, t.expert))


def test_a_batch_waits_on_the_fences_of_every_task_in_it():
    transport = CountingSync()
    engine, _, _ = _engine(transport)
    f1, f2, f3 = (transport_mod.EventHandle() for _ in range(3))
    for f in (f1, f2, f3):
        f.event.set()
    engine.submit(0, 0, 0, high=True, after=[f1])
    engine.submit(0, 1, 1, high=True, after=[f2, f1])
    engine.submit(0, 2, 2, high=True, after=[f3])
    engine.pump()
    (_, after), = transport.batches
    assert after == (f1, f2, f3)  # the union, each once


def test_without_copy_batch_or_with_batch_bytes_zero_one_chunk_per_issue():
    engine, _, _ = _engine(SyncTransport(), chunks=3, batch_bytes=0)
    engine.submit(0, 0, 0, high=True)
    assert engine.pump(1) == 1 and engine.pending()[0].next_chunk == 1
    engine2, _, _ = _engine(ScriptedTransport("eager"), chunks=3)  # the scripted transport has no copy_batch
    engine2.submit(0, 0, 0, high=True)
    engine2.pump()
    assert (engine2.batches, engine2.copies) == (3, 3)


class GatedSync(SyncTransport):
    """copy_batch blocks until the test opens the gate (a pageable-memory copy that takes its time)."""

    asynchronous = True

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()

    def copy_batch(self, pairs, after=()):
        self.entered.set()
        assert self.gate.wait(10.0), "test never opened the gate"
        return super().copy_batch(pairs, after)


def test_copies_are_issued_outside_the_queue_lock():
    transport = GatedSync()
    engine, store, pool = _engine(transport)
    try:
        first = engine.submit(0, 0, 0, high=False)
        assert transport.entered.wait(10.0)  # the worker is inside the transport with first's chunk
        assert first.in_transit == 1 and not first.issued  # a prediction: one chunk per issue
        # the queue stays usable meanwhile: these return while the copy call is still blocked
        needed = engine.submit(0, 1, 1, high=True)
        assert engine.pending() == [needed, first] and engine.head() is needed
        fences: list = []
        canceller = threading.Thread(target=lambda: fences.extend(engine.cancel(first)))
        canceller.start()
        canceller.join(0.2)
        assert canceller.is_alive()  # cancel waits for the handle of the chunk in transit
        transport.gate.set()
        canceller.join(10.0)
        assert not canceller.is_alive() and len(first.handles) == 1 and first.in_transit == 0
        assert engine.cancelled_chunks == 2  # its other two chunks never moved
        engine.wait_issued(needed)
        assert torch.equal(pool.buffer[1], store.region(0, 1))
    finally:
        transport.gate.set()
        engine.close()


class FakeEvent:
    """torch.cuda.Event stand-in: completes when the test says."""

    made = 0

    def __init__(self, blocking=False, enable_timing=False) -> None:
        assert blocking, "copy events must be created with blocking sync"
        FakeEvent.made += 1
        self.done = False
        self.records = 0

    def record(self, stream=None) -> None:
        self.done, self.records = False, self.records + 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_event_pool_reuses_completed_events_and_old_handles_read_done(monkeypatch):
    monkeypatch.setattr(transport_mod.torch.cuda, "Event", FakeEvent)
    FakeEvent.made = 0
    pool = transport_mod.EventPool()
    a = pool.record(None)
    b = pool.record(None)
    assert FakeEvent.made == 2 and not a.query() and not b.query()
    a.event.done = True
    c = pool.record(None)  # a's event completed: reused, not created
    assert FakeEvent.made == 2 and c.event is a.event and c.event.records == 2
    assert a.query() and not a.current and not c.query()  # a's own work is done; c marks the new record
    a.synchronize()  # never waits on the re-recorded event
    assert not c.query()
    b.event.done = c.event.done = True
    for _ in range(10):
        h = pool.record(None)
        h.event.done = True
    assert FakeEvent.made == 2 and pool.created == 2


# ---------------------------------------------------------------------------------------------- ordering guards
class BatchHandle:
    """A batch of the scripted transport: completes when every copy in it landed (each lands on its own)."""

    def __init__(self, members: list[ScriptedHandle]) -> None:
        self.after = tuple(members)  # the dependency chain the scripted transport follows

    def query(self) -> bool:
        return all(m.landed for m in self.after)

    def synchronize(self) -> None:
        for m in self.after:
            m.synchronize()


class BatchedScriptedTransport(ScriptedTransport):
    """The scripted transport with ``copy_batch``: every copy of a batch waits on the batch's fences and lands
    whenever the script lands it; the batch's handle completes after the last."""

    def copy_batch(self, pairs, after=()):
        self.batch_sizes.append(len(pairs))
        return BatchHandle([self.copy(dst, src, after) for dst, src in pairs])

    def force(self, handle) -> None:
        if isinstance(handle, BatchHandle):
            for m in handle.after:
                self.force(m)
            return
        super().force(handle)

    def __init__(self, mode: str = "late") -> None:
        super().__init__(mode)
        self.batch_sizes: list[int] = []


class OnlyFirstTasksFences(CopyEngine):
    """Mutant: a batch waits only for its first task's fences (the union dropped)."""

    def _copy(self, pieces):
        first = pieces[0][0]
        saved = {id(t): (t, t.after) for t, _, _ in pieces if t is not first}
        for t, _ in saved.values():
            t.after = ()
        try:
            return super()._copy(pieces)
        finally:
            for t, after in saved.values():
                t.after = after


def _run(synth, expected, mode, engine_cls=None, **config):
    transport = BatchedScriptedTransport(mode)
    backend, stats = synth.offloaded(transport_object=transport, copy_engine=engine_cls, **config)
    try:
        with transport.deferring_compute(kernels):
            got = synth.run(backend, stats)
            backend.synchronize()
        multi_task = backend.engine.batches < backend.engine.tasks
    finally:
        backend.close()
    same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    return transport, same, multi_task


@pytest.fixture(scope="module")
def synth():
    s = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=11, steps=6, prefill_tokens=9)
    return s, s.run(s.resident())


CASES = [dict(policy="lru", gpu_expert_slots=n) for n in (2, 3, 5)] + [
    dict(policy="ondemand", gpu_expert_slots=2, prefill_ring_slots=2),
    dict(policy="mixtral-offloading", gpu_expert_slots=6, prefetch_distance=2),
]


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_batched_copies_keep_every_fence(synth, mode):
    """Exact outputs and no hazard with batches spanning several tasks, every copy landing as late (or as early)
    as its fences allow."""
    s, expected = synth
    spanned = False
    for config in CASES:
        transport, same, multi_task = _run(s, expected, mode, **config)
        assert transport.hazards == [], f"{config}: {transport.hazards[:3]}"
        assert same, f"{config} mode={mode}: outputs differ"
        spanned |= multi_task and max(transport.batch_sizes, default=0) > 1
    assert spanned  # some batches did carry several tasks' copies


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_a_dropped_fence_of_a_batched_task_is_caught(synth, mode):
    """The guard: passing only the first task's fences for a batch poisons slots here (the mutant is killed)."""
    s, expected = synth
    caught = 0
    for config in CASES:
        transport, same, _ = _run(s, expected, mode, engine_cls=OnlyFirstTasksFences, **config)
        caught += bool(transport.hazards) or not same
    assert caught == len(CASES)  # killed in every case
