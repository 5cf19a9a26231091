"""The GPU-only branches of the host path, run on the CPU with CUDA's streams, events and graphs stood in for.

Nothing here proves stream ordering (the GPU lane's race harness does, tests/test_cuda_lane.py); it runs the
Python of the branches a CPU run never takes: the read-back's staging, pinned copies and one event wait, the
pinned ring of the slot tables, the CUDA transport's fences, stall timing and stream check, the graph capture's
begin / end / abort. Each is compared with the CPU branch or with what its docstring promises, so an index slip
or a renamed call there fails on CI instead of in a lent GPU's first minute.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from moeflow.engine import cuda_graphs
from moeflow.offload import readback, transport
from moeflow.offload.device_step import StaticSlotTable
from moeflow.offload.readback import AsyncHostCopy, PinnedRing, ReadBack, SlotTables, pack_slot_table


class FakeStream:
    handles = 0

    def __init__(self, device=None, priority: int = 0, name: str = "side") -> None:
        self.name = name
        FakeStream.handles += 1
        self.cuda_stream = 0x1000 + FakeStream.handles  # the raw cudaStream_t stand-in
        self.waited: list[FakeEvent] = []
        self.waited_streams: list[FakeStream] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_streams.append(other)

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeCuda:
    """What the tests read back: the current stream, every event made, host waits."""

    def __init__(self) -> None:
        self.default = FakeStream(name="compute")
        self.current = self.default
        self.events: list[FakeEvent] = []
        self.clock = 0.0


class FakeEvent:
    cuda: FakeCuda  # set by the fixture

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.blocking, self.enable_timing = blocking, enable_timing
        self.done = True  # the tests flip it to model work still running
        self.records: list[FakeStream] = []
        self.synchronized = 0
        self.time = 0.0
        self.cuda.events.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        self.records.append(stream or self.cuda.current)
        self.cuda.clock += 1.0
        self.time = self.cuda.clock

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.time - self.time  # "milliseconds"


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    FakeEvent.cuda = cuda

    @contextlib.contextmanager
    def stream(s):
        before, cuda.current = cuda.current, s
        try:
            yield
        finally:
            cuda.current = before

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    from moeflow.kernels import workspace

    monkeypatch.setattr(workspace, "_raw_current_stream", lambda index: cuda.current.cuda_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(readback, "_pinned", lambda n, dtype, pin: torch.zeros(n, dtype=dtype))
    return cuda


def test_staged_read_back_equals_the_in_place_read(fake_cuda):
    g = torch.Generator().manual_seed(0)
    staged = ReadBack("cpu", num_experts=16, capacity=8, staged=True)  # grows past its capacity
    plain = ReadBack("cpu", num_experts=16)
    for T in (1, 3, 16):
        topk = torch.randint(0, 16, (T, 4), generator=g)
        proposals = [torch.randint(-1, 16, (5,), generator=g), torch.randint(0, 16, (2, 3), generator=g).int()]
        probs = [torch.rand(T, 16, generator=g), torch.rand(2, 3, generator=g).half()]
        got, want = staged.read(topk, proposals, probs), plain.read(topk, proposals, probs)
        assert got[0] == want[0] == sorted(set(topk.reshape(-1).tolist()))
        assert got[1] == want[1]
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))
    assert staged.blocking_reads == 3
    assert staged.event.synchronized == 3 and len(staged.event.records) == 3  # one event wait per read
    int_buffer = staged._int_host.data_ptr()
    staged.read(torch.zeros(1, 4, dtype=torch.int64), [torch.arange(5)], [torch.rand(1, 16)])
    assert staged._int_host.data_ptr() == int_buffer  # persistent: no buffer per call once grown


def test_a_captured_staging_reads_back_what_a_post_does(fake_cuda):
    """The read-back's staging as a CUDA-graph piece holds it (``capture_stage``: mask and ids copied into its own
    persistent buffers, no event) and the eager rest (``post_captured``: the event, then one wait at collect)
    give what a plain read gives; the buffers are made once per read size."""
    staged, plain = ReadBack("cpu", num_experts=8, staged=True), ReadBack("cpu", num_experts=8)
    with pytest.raises(RuntimeError, match="without a captured staging"):
        staged.post_captured(torch.tensor([[1, 2]]))
    buffers = {}
    reads = [(torch.tensor([[3, 5], [5, 0]], dtype=torch.int32), [torch.tensor([4, -1]), torch.tensor([6])]),
             (torch.tensor([[7, 1]]), []), (torch.tensor([[2, 2]], dtype=torch.int32), [torch.tensor([0, 7, 1])])]
    for i, (topk, ids) in enumerate(reads * 2):
        staged.capture_stage(topk, ids)
        assert len(staged.event.records) == i  # the piece records no event: post_captured does, eagerly
        staged.post_captured(topk, ids)
        got, want = staged.collect(), plain.read(topk, ids)
        assert got[0] == want[0] == sorted(set(topk.reshape(-1).tolist())) and got[1] == want[1] and got[2] == []
        n = 8 + sum(t.numel() for t in ids)
        now = tuple(t.data_ptr() for t in staged._captured[n])
        assert buffers.setdefault(n, now) == now
    assert staged.blocking_reads == 6 and staged.event.synchronized == 6 and len(staged._captured) == 2


def test_a_posted_read_back_is_waited_for_only_at_collect(fake_cuda):
    """Early hits enqueue the layer's first expert group between ``post`` (staging, copies, the event recorded)
    and ``collect`` (the one host wait): the event is recorded at post and synchronized at collect only."""
    rb = ReadBack("cpu", num_experts=8, staged=True)
    topk = torch.tensor([[3, 5]])
    rb.post(topk, [torch.tensor([1, -1])])
    assert len(rb.event.records) == 1 and rb.event.synchronized == 0 and rb.blocking_reads == 0
    needed, lists, _ = rb.collect()
    assert needed == [3, 5] and lists == [[1, -1]]
    assert rb.event.synchronized == 1 and rb.blocking_reads == 1
    with pytest.raises(RuntimeError, match="without a posted read"):
        rb.collect()


def test_async_host_copy_reads_only_once_its_event_completed(fake_cuda):
    copy = AsyncHostCopy("cpu", capacity=2, staged=True)
    copy.post(torch.tensor([[3, 1], [-1, 7]]))  # past its capacity: grown
    assert copy.event.records == [fake_cuda.default]
    copy.event.done = False
    assert not copy.ready()  # polled, never waited on
    copy.event.done = True
    assert copy.ready() and copy.values() == [3, 1, -1, 7]


def test_slot_tables_through_the_pinned_ring(fake_cuda):
    staged, plain = SlotTables("cpu", num_experts=6, staged=True), SlotTables("cpu", num_experts=6)
    seen = []
    for call in range(2 * SlotTables.RING):
        experts = sorted({call % 6, (call * 5 + 1) % 6})
        slots = [(e * 7 + call) % 11 for e in experts]
        got, want = staged.fill(experts, slots), plain.fill(experts, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        seen.append(got[0].data_ptr())
    assert seen[: SlotTables.RING] == seen[SlotTables.RING :]  # the ring's device buffers, reused in order
    assert len(set(seen[: SlotTables.RING])) == SlotTables.RING
    ring = staged.ring
    assert [len(e.records) for e in ring.events] == [2] * SlotTables.RING
    assert [e.synchronized for e in ring.events] == [2] * SlotTables.RING  # each refill waits for its last copy


def test_static_slot_table_fills_through_the_ring(fake_cuda):
    table = StaticSlotTable(torch.device("cpu"), num_experts=4)
    table.ring = PinnedRing(8, StaticSlotTable.RING)
    address = table.table.data_ptr()
    table.fill(pack_slot_table([1, 3], [5, 0], 4))
    table.derive_mask()
    assert table.table.data_ptr() == address  # the graphs read this address
    assert table.expert_mask.tolist() == [False, True, False, True]
    assert table.slot_of_expert[1].item() == 5 and table.slot_of_expert[3].item() == 0


def test_cuda_transport_fences_stalls_and_stream_check(fake_cuda):
    t = transport.make_transport("auto", torch.device("cuda"))
    assert isinstance(t, transport.CudaTransport) and t.compute_stream is fake_cuda.default
    dst, src = torch.zeros(2, 4), torch.arange(8.0).view(2, 4)
    stale = t.compute_fence()
    fence = t.compute_fence()  # the pool recycled the first fence's completed event for it
    assert fence.event is stale.event and not stale.current  # so the first one reads as done
    fence.event.done = False
    handle = t.copy_batch([(dst[0], src[0]), (dst[1], src[1])], after=[fence, stale])
    assert torch.equal(dst, src)
    assert t.stream.waited == [fence.event]  # the copy stream waits on the live fence only
    assert handle.event.records == [t.stream]

    handle.event.done = False
    assert t.wait_compute([handle, handle]) == 0.0  # device-side wait: no host time
    assert fake_cuda.default.waited == [handle.event]  # one wait for a handle given twice
    start_events = [e for e in fake_cuda.events if e.enable_timing]
    assert len(start_events) == 2  # one timing pair brackets the wait
    start_events[1].done = False
    assert t.collect_stall_s() == 0.0 and len(t._stall_events) == 1  # not completed yet: kept
    start_events[1].done = True
    assert t.collect_stall_s() == pytest.approx(start_events[1].time / 1e3 - start_events[0].time / 1e3)
    handle.event.done = True
    assert t.wait_compute([handle]) == 0.0 and fake_cuda.default.waited == [handle.event]  # done: no new wait

    with torch.cuda.stream(FakeStream(name="other")), pytest.raises(RuntimeError, match="transport was built"):
        t.compute_fence()
    with torch.cuda.stream(FakeStream(name="other")), pytest.raises(RuntimeError, match="transport was built"):
        t.wait_compute([handle])


def test_the_transport_checks_its_stream_by_the_raw_handle(fake_cuda, monkeypatch):
    """Each fence (two or more per decode layer) checks that the model still computes on the bound stream through
    the raw handle, never building a ``torch.cuda.current_stream`` object (~18 us each on the H100's host)."""
    t = transport.make_transport("auto", torch.device("cuda"))
    objects = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: objects.append(1) or fake_cuda.current)
    for _ in range(3):
        t.compute_fence()
    t.wait_compute([t.compute_fence()])
    assert objects == []
    with torch.cuda.stream(FakeStream(name="other")), pytest.raises(RuntimeError, match="transport was built"):
        t.compute_fence()
    assert objects == [1]  # the error names the stream: built only then


class FakeGraph:
    made: list[FakeGraph] = []

    def __init__(self) -> None:
        self.calls: list[str] = []
        FakeGraph.made.append(self)

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self.calls.append(f"begin:{capture_error_mode}")

    def capture_end(self) -> None:
        self.calls.append("end")
        if "fail" in self.calls:
            raise RuntimeError("capture invalidated")

    def replay(self) -> None:
        self.calls.append("replay")


def test_cuda_capture_begin_end_abort(fake_cuda, monkeypatch):
    FakeGraph.made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    capture = cuda_graphs.CudaCapture(torch.device("cuda"))
    with capture.side_stream():
        assert fake_cuda.current is capture.stream
        capture.begin()
        replay = capture.end()
    assert fake_cuda.current is fake_cuda.default
    assert capture.stream.waited_streams == [fake_cuda.default] and fake_cuda.default.waited_streams == [capture.stream]
    replay()
    assert FakeGraph.made[0].calls == ["begin:thread_local", "end", "replay"]
    capture.begin()
    FakeGraph.made[1].calls.append("fail")
    capture.abort()  # the capture's own error is swallowed: the caller keeps the first one
    assert capture._graph is None and FakeGraph.made[1].calls[-1] == "end"
    capture.abort()  # nothing open: no-op


def test_the_race_harness_transport_overrides_every_copy_entry_the_engine_calls():
    """The GPU race harness poisons and delays copies by overriding the transport's copy methods; when the copy
    engine moved to ``copy_batch`` the harness kept overriding only ``copy`` and silently tested nothing (its
    copy count stayed 0 on the lent H100). Every copy entry of CudaTransport must be the harness's own, or reach
    one through ``copy_batch``."""
    import inspect

    from race_transport import RaceTransport

    from moeflow.offload.transport import CudaTransport

    entries = [n for n, f in vars(CudaTransport).items() if n.startswith("copy") and callable(f)]
    assert "copy_batch" in entries
    for name in entries:
        own = name in vars(RaceTransport)
        delegates = "self.copy_batch(" in inspect.getsource(getattr(CudaTransport, name))
        assert own or (delegates and "copy_batch" in vars(RaceTransport)), name
    from moeflow.offload import copy_engine

    source = inspect.getsource(copy_engine)
    engine_calls = set(re.findall(r"transport\.(copy\w*)\b", source))  # calls and bound methods kept
    assert engine_calls == {"copy", "copy_batch"}, engine_calls  # a new entry: the harness must override it too
    assert engine_calls <= set(entries)


def test_scratch_stream_key_is_the_raw_current_stream_of_the_device(fake_cuda, monkeypatch):
    """workspace's key on CUDA: the raw handle of the device's current stream, the query Triton's launcher makes
    (``torch._C._cuda_getCurrentRawStream``), no ``torch.cuda.current_stream`` object per request; without that
    binding, ``current_stream(index).cuda_stream``, the same handle. The stand-ins follow ``torch.cuda.stream``."""
    from moeflow.kernels import workspace

    handles = {"compute": 100, "side": 200}
    asked: list[int] = []

    def raw(index: int) -> int:
        asked.append(index)
        return handles[fake_cuda.current.name]

    def stream_object(device=None):
        asked.append(-1)  # not expected while the raw query exists
        return type("S", (), {"cuda_stream": handles[fake_cuda.current.name]})()

    monkeypatch.setattr(torch.cuda, "current_stream", stream_object)
    monkeypatch.setattr(workspace, "_raw_current_stream", raw)
    side = FakeStream(name="side")
    cuda1 = torch.device("cuda", 1)
    assert workspace._stream_key(cuda1) == 100
    with torch.cuda.stream(side):
        assert workspace._stream_key(cuda1) == 200
    assert workspace._stream_key(cuda1) == 100 and asked == [1, 1, 1]
    monkeypatch.setattr(workspace, "_raw_current_stream", None)  # a torch without the raw binding
    with torch.cuda.stream(side):
        assert workspace._stream_key(cuda1) == 200
    assert workspace._stream_key(torch.device("cpu")) == 0


def test_scratch_buffers_and_views_per_stream(monkeypatch):
    """One buffer per (name, stream, dtype), one cached view per shape; a grown buffer drops its stale views."""
    from moeflow.kernels import workspace

    stream = [1]
    monkeypatch.setattr(workspace, "_stream_key", lambda device: stream[0])
    workspace.clear()
    cpu = torch.device("cpu")
    a = workspace.scratch("t", (2, 3), torch.float32, cpu)
    assert workspace.scratch("t", (2, 3), torch.float32, cpu) is a  # the same view, no slice / view ops
    b = workspace.scratch("t", (4,), torch.float32, cpu)
    assert b.data_ptr() == a.data_ptr() and b.shape == (4,)
    stream[0] = 2  # another stream: its own buffer
    assert workspace.scratch("t", (2, 3), torch.float32, cpu).data_ptr() != a.data_ptr()
    stream[0] = 1
    grown = workspace.scratch("t", (5, 5), torch.float32, cpu)
    again = workspace.scratch("t", (2, 3), torch.float32, cpu)
    assert again is not a and again.data_ptr() == grown.data_ptr()  # the old view pointed at the old buffer
    workspace.clear()
