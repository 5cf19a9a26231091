"""Unit tests of the scheduler's parts, part 1: transports, host store, copy engine (part 2, the cache,
eviction, config and stats: test_scheduling_cache.py)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from test_scheduling_helpers import AWQ, DENSE, random_expert

from moeflow.kernels.formats import ALIGN
from moeflow.kernels.pool import ExpertPool
from moeflow.offload import (
    CopyEngine,
    HostStore,
    RandomDelayTransport,
    Stats,
    SyncTransport,
    chunk_ranges,
    make_transport,
)
from moeflow.offload import host_store as host_store_mod
from moeflow.offload.transport import EventHandle


# ---------------------------------------------------------------------------------------------- transports
def test_chunk_ranges_cover_exactly_and_align():
    for nbytes in (ALIGN, 3 * ALIGN, DENSE.nbytes, AWQ.nbytes, 1000 * ALIGN):
        for n in (1, 2, 3, 4, 7):
            ranges = chunk_ranges(nbytes, n)
            assert ranges[0][0] == 0 and ranges[-1][1] == nbytes and len(ranges) <= n
            for (a, b), (c, _) in zip(ranges, ranges[1:], strict=False):
                assert b == c and a % ALIGN == 0 and b > a


def test_sync_transport_copies_at_once():
    t = SyncTransport()
    dst, src = torch.zeros(10), torch.arange(10.0)
    h = t.copy(dst, src)
    assert h.query() and torch.equal(dst, src) and t.compute_fence().query()


def test_random_delay_transport_completes_late_and_out_of_order():
    # delays up to 30 ms dwarf thread wake-up noise on a loaded machine (4 ms did not, 1 run in 3 failed)
    t = RandomDelayTransport(max_delay_s=0.03, seed=1, workers=3)
    dsts = [torch.zeros(64) for _ in range(24)]
    order: list[int] = []
    handles = []
    for i, d in enumerate(dsts):
        handles.append(t.copy(d, torch.full((64,), float(i))))
    assert not all(h.query() for h in handles)  # late: nothing waited yet
    lock = threading.Lock()

    def watch(i, h):
        h.synchronize()
        with lock:
            order.append(i)

    threads = [threading.Thread(target=watch, args=(i, h)) for i, h in enumerate(handles)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.synchronize()
    assert all(torch.all(d == i) for i, d in enumerate(dsts))
    assert order != sorted(order)  # out of order (24 copies on 3 threads with random delays)
    t.close()


def test_random_delay_transport_honours_after():
    t = RandomDelayTransport(max_delay_s=0.003, seed=2)
    for trial in range(20):
        dst = torch.zeros(128)
        h1 = t.copy(dst, torch.full((128,), 1.0))
        h2 = t.copy(dst, torch.full((128,), 2.0), after=[h1])
        h2.synchronize()
        assert torch.all(dst == 2.0), trial
    t.close()


def test_random_delay_error_reaches_the_waiter():
    t = RandomDelayTransport(max_delay_s=0.0)
    h = t.copy(torch.zeros(3), torch.zeros(4))  # shape mismatch inside the worker thread
    with pytest.raises(RuntimeError, match="random-delay"):
        h.synchronize()
    t.close()


def test_make_transport_names():
    assert make_transport("auto", torch.device("cpu")).name == "sync"
    assert make_transport("sync", torch.device("cpu")).name == "sync"
    rd = make_transport("random-delay", torch.device("cpu"), random_delay_ms=1.0)
    assert rd.name == "random-delay" and rd.asynchronous
    rd.close()
    with pytest.raises(ValueError, match="unknown transport"):
        make_transport("carrier-pigeon", torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- host store
def _filled_store(fmt=DENSE, layers=2, experts=3, seed=0):
    store = HostStore(fmt, layers, experts, pin=True, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for l in range(layers):
        for e in range(experts):
            weights[l, e] = random_expert(fmt, gen)
            store.write(l, e, weights[l, e])
    return store, weights


@pytest.mark.parametrize("fmt", [DENSE, AWQ], ids=["dense", "awq"])
def test_host_region_is_byte_identical_to_a_slot(fmt):
    store, weights = _filled_store(fmt)
    pool = ExpertPool.allocate(fmt, 2, "cpu")
    pool.buffer.zero_()  # padding between tensors: the store zeroes its own
    fmt.write(pool.buffer[1], weights[1, 2])
    assert torch.equal(store.region(1, 2), pool.buffer[1])
    assert store.region(1, 2).data_ptr() == store.buffer.data_ptr() + (1 * 3 + 2) * fmt.nbytes  # a view
    assert not store.pinned and store.missing() == []
    with pytest.raises(IndexError):
        store.region(2, 0)


def test_host_store_reports_missing_experts():
    store = HostStore(DENSE, 2, 2, pin=False, device="cpu")
    store.write(0, 1, random_expert(DENSE, torch.Generator().manual_seed(0)))
    assert store.missing() == [(0, 0), (1, 0), (1, 1)]


class _FakeCudart:
    def __init__(self, result):
        self.result, self.registered, self.unregistered = result, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        if isinstance(self.result, Exception):
            raise self.result
        self.registered.append((ptr, size, flags))
        return self.result

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_host_store_pins_exact_size_with_cuda_host_register(monkeypatch):
    fake = _FakeCudart(0)
    monkeypatch.setattr(host_store_mod.torch.cuda, "cudart", lambda: fake)
    store = HostStore(DENSE, 2, 3, pin=True, device="cuda")
    assert store.pinned
    assert fake.registered == [(store.buffer.data_ptr(), 6 * DENSE.nbytes, 1)]  # exact size, one buffer
    store.close()
    assert fake.unregistered == [store.buffer.data_ptr()] and not store.pinned
    assert store.pin() and store.pin()  # pinned again for a next owner; a second call registers nothing
    assert fake.registered == [(store.buffer.data_ptr(), 6 * DENSE.nbytes, 1)] * 2


@pytest.mark.parametrize("result", [2, RuntimeError("no CUDA")])
def test_host_store_falls_back_to_pageable_with_one_warning(monkeypatch, result):
    monkeypatch.setattr(host_store_mod.torch.cuda, "cudart", lambda: _FakeCudart(result))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = HostStore(DENSE, 2, 3, pin=True, device="cuda")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "pageable" in messages[0] and "bandwidth" in messages[0]
    assert not store.pinned


# ---------------------------------------------------------------------------------------------- copy engine
def _engine(transport=None, n_slots=4, chunks=3, threaded=None, max_inflight=2, batch_bytes=0):
    """batch_bytes=0: one chunk per issue, so these tests follow the chunks one by one (batched issue:
    tests/test_copy_batching.py)."""
    store, weights = _filled_store(DENSE, layers=3, experts=4)
    pool = ExpertPool.allocate(DENSE, n_slots, "cpu")
    pool.buffer.zero_()
    engine = CopyEngine(transport or SyncTransport(), store, pool, chunks=chunks, max_inflight=max_inflight,
                        threaded=threaded, batch_bytes=batch_bytes)
    return engine, store, pool


def test_high_tasks_overtake_low_tasks_between_chunks():
    engine, store, pool = _engine(chunks=3)
    assert len(engine.chunks) == 3
    low = engine.submit(1, 0, 0, high=False)
    assert engine.pump(1) == 1 and low.next_chunk == 1  # one chunk of the prediction is moving
    high = engine.submit(0, 2, 1, high=True)
    engine.pump(1)
    assert high.next_chunk == 1 and low.next_chunk == 1  # the needed expert waited for one chunk only
    engine.pump()
    assert high.complete() and low.complete()
    assert torch.equal(pool.buffer[1], store.region(0, 2)) and torch.equal(pool.buffer[0], store.region(1, 0))


def test_low_queue_orders_by_priority_then_arrival():
    engine, _, _ = _engine()
    a = engine.submit(1, 0, 0, high=False, priority=0.1)
    b = engine.submit(1, 1, 1, high=False, priority=0.9)
    c = engine.submit(1, 2, 2, high=False, priority=0.1)
    h = engine.submit(0, 0, 3, high=True)
    assert engine.pending() == [h, b, a, c]


def test_early_preemption_drops_stale_and_promotes_needed():
    engine, store, pool = _engine(chunks=3)
    stats = Stats().current()
    t0 = engine.submit(2, 0, 0, high=False, stats=stats)
    t1 = engine.submit(2, 1, 1, high=False, stats=stats)
    t2 = engine.submit(2, 3, 2, high=False, stats=stats)
    other = engine.submit(1, 3, 3, high=False, stats=stats)  # another layer's prediction: untouched
    engine.pump(1)  # first chunk of t0 is in flight
    promoted, dropped = engine.preempt(2, needed={1, 3})
    assert promoted == [t1, t2] and dropped == [t0]
    assert t0.cancelled and engine.cancelled_chunks == 2 and t1.high and t2.high and not other.high
    assert engine.pending() == [t1, t2, other]
    engine.pump()
    assert t1.complete() and t2.complete() and other.complete() and not t0.complete()
    chunk0 = engine.chunks[0][1]
    assert stats.bytes_h2d == 3 * DENSE.nbytes + chunk0  # the dropped task moved one chunk only
    assert torch.equal(pool.buffer[0, :chunk0], store.region(2, 0)[:chunk0])
    assert not pool.buffer[0, chunk0:].any()  # ... and nothing else
    with pytest.raises(RuntimeError, match="cancelled"):
        engine.wait_issued(t0)


def test_cancel_returns_fences_of_issued_chunks():
    engine, _, _ = _engine(chunks=2)
    t = engine.submit(0, 0, 0, high=False)
    engine.pump(1)
    assert engine.cancel(t) == []  # sync transport: the one issued chunk already landed
    engine2, _, _ = _engine(transport=RandomDelayTransport(max_delay_s=0.05), chunks=2, threaded=False)
    t2 = engine2.submit(0, 0, 0, high=False)
    engine2.pump(1)
    fences = engine2.cancel(t2)
    assert len(fences) == 1 and isinstance(fences[0], EventHandle)
    fences[0].synchronize()
    engine2.transport.close()


def test_threaded_engine_with_random_delays_moves_every_byte():
    transport = RandomDelayTransport(max_delay_s=0.002, seed=3)
    engine, store, pool = _engine(transport=transport, n_slots=12, chunks=3, max_inflight=3)
    tasks = []
    for i in range(12):
        layer, expert = divmod(i, 4)
        tasks.append(engine.submit(layer, expert, i, high=i % 3 == 0))
    for t in tasks:
        engine.wait_issued(t)
        for h in t.handles:
            h.synchronize()
    for i, t in enumerate(tasks):
        assert t.complete() and torch.equal(pool.buffer[i], store.region(t.layer, t.expert))
    engine.close()
    transport.close()


def test_worker_failure_is_raised_at_the_next_wait():
    class Broken(SyncTransport):
        asynchronous = True

        def copy(self, dst, src, after=()):
            raise OSError("DMA engine on fire")

    engine, _, _ = _engine(transport=Broken())
    task = engine.submit(0, 0, 0, high=True)
    with pytest.raises(RuntimeError, match="copy engine worker failed"):
        engine.wait_issued(task)
    engine.close()


def test_throttle_keeps_inflight_bounded():
    transport = RandomDelayTransport(max_delay_s=0.01, seed=4)
    engine, _, _ = _engine(transport=transport, n_slots=8, chunks=4, max_inflight=2)
    seen = []
    orig = transport.copy

    def spy(dst, src, after=()):
        seen.append(sum(1 for h in engine._inflight if not h.query()))
        return orig(dst, src, after)

    transport.copy = spy
    tasks = [engine.submit(0, i % 4, i, high=False) for i in range(6)]
    for t in tasks:
        engine.wait_issued(t)
    assert max(seen) <= 2
    engine.close()
    transport.close()
