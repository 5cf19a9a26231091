"""The layer's one blocking device->host read: :class:`ReadBack`.

Everything the host needs to schedule a layer (which experts its tokens chose, the predictor's proposals,
the routing probabilities a host-side predictor searches with) is gathered on the device into persistent
staging buffers, copied in one asynchronous copy per dtype into persistent pinned host buffers, and waited
for with one event (created with ``blocking=True``: the host thread sleeps instead of spinning a core).
Nothing else on the scheduling path reads device memory: no ``bincount`` (it reads min/max back on CUDA),
``.item()``, ``.tolist()`` or data-dependent shapes of device tensors.

``blocking_reads`` counts the reads (tests install a counter on it; the GPU profile shows one
``cudaEventSynchronize`` per MoE layer). :class:`AsyncHostCopy` is the non-blocking sibling: a copy whose
completion is polled (``ready``) and never waited for on the scheduling path (DuoServe's prediction stream).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _pinned(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer, page-locked when ``pin`` (then a device copy from or into it can be asynchronous)."""
    return torch.zeros(n, dtype=dtype, pin_memory=pin)


class ReadBack:
    """Persistent device staging + pinned host buffers for one backend (grown on demand, never per call).

    ``staged`` (default: on a CUDA device) selects the GPU path: device staging buffers, one asynchronous copy
    per dtype into pinned host buffers, one event wait. The tests run that path on host tensors with CUDA's
    streams and events stood in for (tests/test_cuda_paths_emulated.py); without it the CPU reads in place.
    """

    def __init__(self, device: torch.device | str, num_experts: int, capacity: int = 256,
                 staged: bool | None = None, on_wait: Callable[[], None] | None = None) -> None:
        self.device = torch.device(device)
        self.num_experts = num_experts
        self.cuda = self.device.type == "cuda" if staged is None else staged
        self.mask = torch.zeros(num_experts, dtype=torch.int64, device=self.device)  # needed-expert mask
        self._int_dev, self._int_host = self._alloc(capacity, torch.int64)
        self._flt_dev, self._flt_host = self._alloc(0, torch.float32)
        self.event = torch.cuda.Event(blocking=True) if self.cuda else None
        self.blocking_reads = 0
        self._pending: tuple | None = None  # the posted read collect() waits for
        # the captured stagings' own buffers (capture_stage), one pair per read size, never grown: a graph's
        # addresses stay valid
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_wait = on_wait  # the simulator's host clock: the wait for the routing and the scheduling

    def _alloc(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        host = _pinned(n, dtype, self.cuda)
        return (torch.empty(n, dtype=dtype, device=self.device) if self.cuda else host), host

    def read(
        self, topk_ids: torch.Tensor, ids: list[torch.Tensor], floats: list[torch.Tensor] = ()
    ) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
        """topk_ids int [T, k]; ids: int tensors (proposals); floats: fp32 tensors (e.g. probs [T, E]) ->
        (needed experts ascending, each ``ids`` tensor as a host list, each ``floats`` tensor as a host copy
        of its shape). One blocking wait: :meth:`post` then :meth:`collect`."""
        self.post(topk_ids, ids, floats)
        return self.collect()

    def post(self, topk_ids: torch.Tensor, ids: list[torch.Tensor], floats: list[torch.Tensor] = ()) -> None:
        """Enqueue the read (staging and the asynchronous copies, on a GPU); :meth:`collect` waits for it. Work
        enqueued in between (a layer's early expert groups) runs on the device while the host waits."""
        if not self.cuda:  # host memory already: read in place at collect
            self._pending = (topk_ids, ids, floats)
            return
        n = self.num_experts + sum(t.numel() for t in ids)
        if n > self._int_host.numel():
            self._int_dev, self._int_host = self._alloc(2 * n, torch.int64)
        self._stage_ints(topk_ids, ids, self._int_dev[:n], self._int_host[:n])
        m = sum(t.numel() for t in floats)
        if m > self._flt_host.numel():
            self._flt_dev, self._flt_host = self._alloc(2 * m, torch.float32)
        if m:
            torch.cat([t.reshape(-1).float() for t in floats], out=self._flt_dev[:m])
            self._flt_host[:m].copy_(self._flt_dev[:m], non_blocking=True)
        self.event.record()
        self._pending = (n, [t.numel() for t in ids], [t.shape for t in floats], self._int_host)

    def capture_stage(self, topk_ids: torch.Tensor, ids: list[torch.Tensor] = ()) -> None:
        """The device part of a :meth:`post` of ``topk_ids`` [T, k] and ``ids`` (no floats), for a CUDA-graph piece to
        hold: the needed-expert mask and the ids into a persistent device buffer and its asynchronous copy into a
        persistent pinned one (a pair per read size, made at the first call: the capture's warm-up, outside any
        capture; shared by every layer and captured step: the host reads a layer's copy before the next piece
        runs). :meth:`post_captured` then records the event, eagerly after the piece's replay. Nothing on the CPU
        (read in place)."""
        if not self.cuda:
            return
        n = self.num_experts + sum(t.numel() for t in ids)
        if n not in self._captured:
            self._captured[n] = (torch.zeros(n, dtype=torch.int64, device=self.device), _pinned(n, torch.int64, True))
        self._stage_ints(topk_ids, ids, *self._captured[n])

    def _stage_ints(self, topk_ids: torch.Tensor, ids: list[torch.Tensor], dev: torch.Tensor,
                    host: torch.Tensor) -> None:
        """The needed-expert mask of ``topk_ids`` [T, k] and ``ids`` into ``dev`` int64 [n] (E + the ids' sizes),
        then its asynchronous copy into ``host`` [n] (pinned): the device part of every read."""
        self.mask.zero_()
        self.mask.index_fill_(0, topk_ids.reshape(-1).long(), 1)  # not bincount: that reads min/max back on CUDA
        torch.cat([self.mask, *(t.reshape(-1).to(torch.int64) for t in ids)], out=dev)
        host.copy_(dev, non_blocking=True)

    def post_captured(self, topk_ids: torch.Tensor, ids: list[torch.Tensor] = ()) -> None:
        """:meth:`post` of ``topk_ids`` and ``ids`` whose :meth:`capture_stage` ran in the piece just replayed (the
        same static tensors): only the event is recorded, after it on the stream; :meth:`collect` waits as ever."""
        if not self.cuda:
            self._pending = (topk_ids, ids, [])
            return
        n = self.num_experts + sum(t.numel() for t in ids)
        if n not in self._captured:
            raise RuntimeError("ReadBack.post_captured without a captured staging")
        self.event.record()
        self._pending = (n, [t.numel() for t in ids], [], self._captured[n][1])

    def collect(self) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
        """The posted read's (needed experts, ``ids`` as host lists, ``floats`` as host copies): one wait."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("ReadBack.collect without a posted read")
        self.blocking_reads += 1
        if self.on_wait is not None:
            self.on_wait()
        if not self.cuda:
            topk_ids, ids, floats = pending
            with torch._C.DisableTorchFunctionSubclass():  # the subclass guard: tests' device stand-in
                return (sorted(set(topk_ids.reshape(-1).tolist())), [t.reshape(-1).tolist() for t in ids],
                        [t.float().clone() for t in floats])
        n, id_sizes, float_shapes, ints = pending
        self.event.synchronize()
        values = ints[:n].tolist()
        E = self.num_experts
        needed = [e for e in range(E) if values[e]]
        lists, at = [], E
        for size in id_sizes:
            lists.append(values[at : at + size])
            at += size
        host_floats, at = [], 0
        for shape in float_shapes:
            size = shape.numel()
            host_floats.append(self._flt_host[at : at + size].view(shape).clone())
            at += size
        return needed, lists, host_floats


def host_proposals(proposals: list[tuple[int, torch.Tensor | list[int]]],
                   fetched: list[list[int]]) -> list[tuple[int, list[int]]]:
    """[(target, device ids or host list)] and the device ones read back, in order -> [(target, host ids)]
    without the padding (< 0)."""
    if not proposals:
        return []
    out, it = [], iter(fetched)
    for target, ids in proposals:
        host = next(it) if isinstance(ids, torch.Tensor) else ids
        out.append((target, [e for e in host if e >= 0]))
    return out



class AsyncHostCopy:
    """An int64 device vector copied to pinned host memory on the current stream; completion is polled.

    ``post(ids)`` stages and copies (no wait); ``ready()`` queries the event (never blocks); ``values()``
    reads the host copy once ready. On the CPU the ids are host memory already: nothing is copied, ``values()``
    reads them where they are (a caller posts a fresh tensor and never writes it after).
    """

    def __init__(self, device: torch.device | str, capacity: int = 64, staged: bool | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" if staged is None else staged
        self.host = _pinned(capacity, torch.int64, True) if self.cuda else None
        self.event = torch.cuda.Event(blocking=True) if self.cuda else None
        self._posted: torch.Tensor | None = None  # what values() reads: the host copy, or the ids themselves

    def post(self, ids: torch.Tensor) -> None:
        if not self.cuda:
            self._posted = ids.reshape(-1)
            return
        n = ids.numel()
        if n > self.host.numel():
            self.host = _pinned(2 * n, torch.int64, True)
        self.host[:n].copy_(ids.reshape(-1).to(torch.int64), non_blocking=True)
        self.event.record()
        self._posted = self.host[:n]

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[int]:
        return self._posted.tolist()


class PinnedRing:
    """A ring of pinned host buffers of ``n`` int32 for host->device copies on the compute stream, none allocated
    per call: buffer i is refilled only after its previous copy ran (its event, long completed ``ring`` copies
    later). The slot tables of the eager launches (:class:`SlotTables`) and of the captured device part
    (:class:`moeflow.offload.device_step.StaticSlotTable`) are staged through it."""

    def __init__(self, n: int, ring: int = 8) -> None:
        self.host = [_pinned(n, torch.int32, True) for _ in range(ring)]
        self.events = [torch.cuda.Event(blocking=True) for _ in range(ring)]
        self.index = 0  # the buffer the next copy goes through

    def copy(self, values: list[int], dst: torch.Tensor) -> None:
        """``values`` into ``dst`` (int32 [n] on the device), asynchronously on the current stream."""
        i = self.index
        self.index = (i + 1) % len(self.host)
        self.events[i].synchronize()  # the copy of a full ring ago (long done): the host buffer is free again
        self.host[i].numpy()[:] = values  # in place: no tensor per call
        dst.copy_(self.host[i], non_blocking=True)
        self.events[i].record()


class SlotTables:
    """The (slot of expert, expert mask) pair of each expert-kernel call.

    On a GPU from persistent buffers: one device buffer per buffer of a :class:`PinnedRing`, each copied on the
    compute stream (so the kernel that reads a device buffer runs before the copy that refills it, ``RING``
    calls later). On the CPU two small fresh tensors per call: the call may still be queued behind others (the
    tests' emulated stream), so a reused buffer could change under it.
    """

    RING = 8

    def __init__(self, device: torch.device | str, num_experts: int, staged: bool | None = None) -> None:
        self.device, self.num_experts = torch.device(device), num_experts
        self.cuda = self.device.type == "cuda" if staged is None else staged
        n = self.RING if self.cuda else 0
        self.ring = PinnedRing(2 * num_experts, self.RING) if self.cuda else None
        self.dev = [torch.zeros(2 * num_experts, dtype=torch.int32, device=self.device) for _ in range(n)]
        self.mask = [torch.zeros(num_experts, dtype=torch.bool, device=self.device) for _ in range(n)]

    def fill(self, experts: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """experts and their slot indices -> (slot_of_expert int32 [E], expert_mask bool [E]) on the device."""
        E = self.num_experts
        packed = pack_slot_table(experts, slots, E)
        if self.ring is None:
            t = torch.tensor(packed, dtype=torch.int32)
            return t[:E], t[E:] != 0
        i = self.ring.index
        dev = self.dev[i]
        self.ring.copy(packed, dev)
        torch.ne(dev[E:], 0, out=self.mask[i])
        return dev[:E], self.mask[i]


def pack_slot_table(experts: list[int], slots: list[int], num_experts: int) -> list[int]:
    """A group's experts and their slots -> [slot of expert e for e < E] + [1 if e is in the group] (2E ints;
    the slot of an expert outside the group is 0, a valid index never read through the mask)."""
    packed = [0] * (2 * num_experts)
    for e, slot in zip(experts, slots, strict=True):
        packed[e], packed[num_experts + e] = slot, 1
    return packed
