"""A transport for tests that lands copies and runs compute in the order the test chooses (GPU stream semantics).

On the CPU every copy and every kernel call finishes when its host call returns, so a missing ordering guard
cannot change a number. :class:`ScriptedTransport` brings the GPU's freedom back, deterministically:

* **compute is deferred.** :meth:`ScriptedTransport.deferring_compute` patches ``kernels.expert_forward`` and
  ``kernels.combine`` so their calls are queued on an emulated compute stream instead of run (a layer's output is
  filled in later); the queue runs only as far as a forced compute fence needs, and at :meth:`synchronize`.
  A ``wait_compute`` is queued too: compute after it sees the awaited copies.
* **copies land when the script says.** ``mode="eager"``: a copy lands as soon as everything in its ``after``
  completed (before compute that is still queued ran: a copy not ordered after a compute fence overwrites the slot
  under the queued reader). ``mode="late"``: a copy lands only when someone needs it (its handle is synchronized
  or waited on by compute), and every older copy still pending lands right after it (a cancelled load lands last,
  over its slot's next expert, unless the next load's ``after`` ordered it first).
* **a hazard poisons the bytes.** A copy landing into bytes a queued kernel call still has to read, or over bytes
  a later-issued copy already wrote, fills its destination with 0xFF (NaN in fp16/bf16/fp32 scales and weights)
  and is recorded in :attr:`hazards`; the outputs then go NaN or wrong, every time.

Handles only complete through this transport, so ``query`` never forces anything: a test sees exactly the
guards the scheduler placed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

POISON = 0xFF  # all-ones bytes: NaN in every float dtype the pool holds


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Absolute byte range [start, end) of a contiguous tensor (or row of one)."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _depends_on(handle, target) -> bool:
    """Whether ``handle`` is ``target`` or waits for it through its ``after`` chain."""
    return handle is target or any(_depends_on(d, target) for d in getattr(handle, "after", ()))


class ScriptedHandle:
    """One copy: lands only through the transport."""

    def __init__(self, transport: ScriptedTransport, seq: int, dst: torch.Tensor, src: torch.Tensor,
                 after: tuple) -> None:
        self.transport, self.seq, self.dst, self.src, self.after = transport, seq, dst, src, after
        self.span = _span(dst)
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.transport.force(self)


class ComputeFence:
    """Completes when the emulated compute stream has run every call queued before it."""

    def __init__(self, transport: ScriptedTransport, position: int) -> None:
        self.transport, self.position = transport, position

    def query(self) -> bool:
        return self.transport.ran >= self.position

    def synchronize(self) -> None:
        self.transport.run_compute(self.position)


class ScriptedTransport:
    """See the module docstring. ``mode``: "eager" or "late"."""

    name = "scripted"
    asynchronous = False  # the copy engine issues inline (pump): the test alone decides the order

    def __init__(self, mode: str = "late") -> None:
        if mode not in ("eager", "late"):
            raise ValueError(f"mode must be 'eager' or 'late', got {mode!r}")
        self.mode = mode
        self.pending: list[ScriptedHandle] = []  # issue order
        self.queue: list[tuple] = []  # emulated compute stream: ("wait", handles) | ("call", fn, spans)
        self.ran = 0  # queue entries executed
        self.hazards: list[str] = []
        self.written: dict[tuple[int, int], int] = {}  # destination span -> seq of the copy that last landed there
        self.landed = 0

    # ----------------------------------------------------------------- Transport interface
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence = ()) -> ScriptedHandle:
        handle = ScriptedHandle(self, len(self.pending) + self.landed, dst, src, tuple(after))
        self.pending.append(handle)
        if self.mode == "eager":
            self._land_ready()
        return handle

    def compute_fence(self) -> ComputeFence:
        return ComputeFence(self, len(self.queue))

    def wait_compute(self, handles: Sequence) -> float:
        self.queue.append(("wait", tuple(handles)))
        return 0.0

    def synchronize(self) -> None:
        self.run_compute(len(self.queue))
        while self.pending:
            self.force(self.pending[0])

    def close(self) -> None:
        return None

    # ----------------------------------------------------------------- the script
    def force(self, handle) -> None:
        """Complete ``handle`` (a copy: its ``after`` first; a fence: the compute before it)."""
        if isinstance(handle, ComputeFence):
            self.run_compute(handle.position)
            return
        if not isinstance(handle, ScriptedHandle) or handle.landed:
            return
        for h in handle.after:
            self.force(h)
        self._land(handle)
        if self.mode == "late":  # the adversary: older copies nobody ordered before this one land after it
            for older in [h for h in self.pending if h.seq < handle.seq]:
                if all(d.query() for d in older.after):
                    self._land(older)
        else:
            self._land_ready()

    def run_compute(self, position: int) -> None:
        """Run the emulated compute stream up to queue entry ``position``."""
        while self.ran < position:
            entry = self.queue[self.ran]
            if entry[0] == "wait":  # fences a forced copy waits for precede this entry: already run
                for h in entry[1]:
                    self.force(h)
            else:
                self._check_reads(entry[2])
                entry[1]()
            self.ran += 1
        if self.mode == "eager":
            self._land_ready()

    def _land_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for h in list(self.pending):
                if all(d.query() for d in h.after):
                    self._land(h)
                    progress = True

    def _check_reads(self, spans: list[tuple[int, int]]) -> None:
        """A kernel call runs now: a copy into its slots that is not ordered after it tears its read (poisoned)."""
        for h in self.pending:
            if any(_overlap(h.span, s) for s in spans) and not self._after_queued_compute(h):
                self.hazards.append(f"a kernel call read a slot while copy #{h.seq} into it was still in flight")
                h.dst.fill_(POISON)

    def _after_queued_compute(self, handle) -> bool:
        """Whether ``handle`` waits (maybe through other copies) for compute that has not run yet."""
        if isinstance(handle, ComputeFence):
            return handle.position > self.ran
        return any(self._after_queued_compute(d) for d in handle.after if not d.query())

    def _queued_readers(self, handle: ScriptedHandle) -> bool:
        """Whether a queued kernel call reads the copy's bytes without waiting for it (it expects the old ones)."""
        waited = False
        for entry in self.queue[self.ran:]:
            if entry[0] == "wait":
                waited = waited or any(_depends_on(h, handle) for h in entry[1])
            elif not waited and any(_overlap(handle.span, s) for s in entry[2]):
                return True
        return False

    def _land(self, handle: ScriptedHandle) -> None:
        if handle.landed:
            return
        self.pending.remove(handle)
        self.landed += 1
        handle.landed = True
        reason = None
        if self._queued_readers(handle):
            reason = f"copy #{handle.seq} landed under a queued kernel call that reads its slot's previous bytes"
        newer = [seq for span, seq in self.written.items() if seq > handle.seq and _overlap(span, handle.span)]
        if newer:
            reason = f"copy #{handle.seq} landed over the bytes of the later copy #{max(newer)}"
        if reason is not None:
            self.hazards.append(reason)
            handle.dst.fill_(POISON)
        else:
            handle.dst.copy_(handle.src)
        self.written = {s: q for s, q in self.written.items() if not _overlap(s, handle.span)}
        self.written[handle.span] = max(handle.seq, *newer) if newer else handle.seq

    # ----------------------------------------------------------------- deferred compute
    @contextlib.contextmanager
    def deferring_compute(self, kernels_module) -> Iterator[None]:
        """Within the block, ``kernels_module.expert_forward`` and ``combine`` calls (and the offload backend's
        eager torch combine, ``combine_in_order``) are queued, not run; so are the CPU int4 slots'
        (``SlotInt4Forms.compute`` / ``combine``, moeflow.offload.cpu_slots) and the captured device part's
        launches (``DeviceGraphs._launch``: inputs copied in, each group's table + replay, the combine)."""
        from moeflow.offload import compute as compute_module  # its eager torch combine (no custom op)
        from moeflow.offload.cpu_slots import SlotInt4Forms
        from moeflow.offload.device_step import DeviceGraphs

        real_forward, real_combine = kernels_module.expert_forward, kernels_module.combine
        real_in_order = compute_module.combine_in_order
        real_int4_compute, real_int4_combine = SlotInt4Forms.compute, SlotInt4Forms.combine
        real_launch, real_graph_combine = DeviceGraphs._launch, DeviceGraphs.combine

        def queued_launch(graphs, work, slots=()):
            self.queue.append(("call", work, [_span(graphs.pool.buffer[s]) for s in slots]))

        def queued_graph_combine(graphs, bucket):
            result = bucket.y.new_empty(bucket.y.shape)  # the static y is overwritten by the next layer's combine
            real_graph_combine(graphs, bucket)  # its launch is queued
            self.queue.append(("call", lambda: result.copy_(bucket.y), []))
            return result

        def queued_int4_compute(forms, layer, x, topk_ids, topk_weights, out, experts, slots):
            spans = [_span(forms.pool.buffer[s]) for s in slots]
            args_now = (forms, layer, x, topk_ids, topk_weights, out, list(experts), list(slots))
            self.queue.append(("call", lambda: real_int4_compute(*args_now), spans))

        def queued_int4_combine(forms, out, top_k):
            result = out.new_empty((out.shape[0] // top_k, out.shape[1]))
            self.queue.append(("call", lambda: result.copy_(real_int4_combine(forms, out, top_k)), []))
            return result

        def queued_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask=None, *args, **kw):
            every = range(slot_of_expert.numel())
            selected = every if expert_mask is None else expert_mask.nonzero().flatten().tolist()
            spans = [_span(pool.buffer[int(slot_of_expert[e])]) for e in selected]
            args_now = (x, topk_ids, topk_weights, pool, slot_of_expert.clone(), out,
                        None if expert_mask is None else expert_mask.clone())
            self.queue.append(("call", lambda: real_forward(*args_now, *args, **kw), spans))
            return out

        def queued_combine(y, top_k, *args, **kw):
            result = y.new_empty((y.shape[0] // top_k, y.shape[1]))  # filled when the stream gets there
            self.queue.append(("call", lambda: result.copy_(real_combine(y, top_k, *args, **kw)), []))
            return result

        def queued_in_order(y, top_k):
            result = y.new_empty((y.shape[0] // top_k, y.shape[1]))
            self.queue.append(("call", lambda: result.copy_(real_in_order(y, top_k)), []))
            return result

        kernels_module.expert_forward, kernels_module.combine = queued_forward, queued_combine
        SlotInt4Forms.compute, SlotInt4Forms.combine = queued_int4_compute, queued_int4_combine
        compute_module.combine_in_order = queued_in_order
        DeviceGraphs._launch, DeviceGraphs.combine = queued_launch, queued_graph_combine
        try:
            yield
        finally:
            kernels_module.expert_forward, kernels_module.combine = real_forward, real_combine
            SlotInt4Forms.compute, SlotInt4Forms.combine = real_int4_compute, real_int4_combine
            compute_module.combine_in_order = real_in_order
            DeviceGraphs._launch, DeviceGraphs.combine = real_launch, real_graph_combine
