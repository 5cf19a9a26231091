"""The device part of an offloaded MoE layer, captured as CUDA graphs (issue 14 item 6).

:meth:`OffloadedExperts.forward <moeflow.offload.backend.OffloadedExperts.forward>` is a host part (the
read-back, the schedule, the copies and their fences) around device work of static shapes: per computed group
of experts, the expert GEMMs over the slot pool into ``out [T*k, H]``; once per layer, the combine into
``y [T, H]``. :class:`DeviceGraphs` runs that device work from persistent buffers only (one :class:`Bucket`
per batch size T: the layer's hidden state, routing ids and weights copied in, ``out``, ``y``, the kernels'
workspace; one :class:`StaticSlotTable` shared by every bucket and layer), so each of the two pieces is
captured once per bucket and replayed for every group of every layer: the pool and the slot table are the
same for all layers, and nothing layer-specific is read except through these buffers. The expert GEMMs are the
format's :meth:`~moeflow.kernels.formats.layout.ExpertFormat.captured_forward` over the bucket's buffers (plain,
biased dense / AWQ, MXFP4, GGUF: their Triton kernels, or their static torch form).

Ordering (why replaying is as safe as the eager launches; docs/design.md, "CUDA graphs"). A graph replay is
one operation of the stream it is launched on: it starts after everything enqueued on that stream before it
and ends before anything enqueued after it. Every replay is launched on the compute stream, where the host
part enqueues, in this order, for a group:

1. ``transport.wait_compute(task.handles)`` (``_wait``): event waits for the group's loads, recorded on the
   compute stream before the replay - not inside the graph, where a captured wait would name the events of the
   capture, not this layer's copies;
2. the slot table: a host buffer of a pinned ring copied into the one device table (the previous replay, which
   read the table, is earlier on the same stream; a ring buffer is rewritten only once its own copy ran, its
   event); the static inputs, copied in at the layer's start, likewise;
3. the replay, then ``transport.compute_fence()`` (``_release_after_compute``): an event recorded after the
   replay, which a copy that reuses the group's slots waits for (``take_fences``), so no copy overwrites a
   slot before the graph's kernels have read it.

Rows the CPU computes (hybrid execution) are copied into ``out`` on the compute stream before the combine's
replay, after the replays of the groups (disjoint rows). On the CPU (the tests) every call finishes before
it returns. A bucket whose capture is refused, or a batch size past ``max_buckets``, runs the layer's old
eager path (``refused`` / ``eager_layers`` say so; the reason is logged once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from moeflow import kernels
from moeflow.kernels.experts import ops
from moeflow.kernels.experts.checks import check_expert_args
from moeflow.kernels.pool import ExpertPool
from moeflow.offload.combine import combine_in_order
from moeflow.offload.readback import PinnedRing, pack_slot_table

log = logging.getLogger(__name__)


class StaticSlotTable:
    """``slot_of_expert`` int32 [E] and ``expert_mask`` bool [E] at fixed device addresses (the graphs read them).

    ``fill`` writes the table of one expert group; on a GPU through a ring of pinned host buffers, each copied
    on the compute stream into the one device table (the mask is derived inside the graph, from the table).
    """

    RING = 8

    def __init__(self, device: torch.device, num_experts: int) -> None:
        self.num_experts = num_experts
        self.table = torch.zeros(2 * num_experts, dtype=torch.int32, device=device)  # slots, then 0/1 mask
        self.slot_of_expert = self.table[:num_experts]
        self.expert_mask = torch.zeros(num_experts, dtype=torch.bool, device=device)
        self.ring = PinnedRing(2 * num_experts, self.RING) if device.type == "cuda" else None

    def fill(self, packed: list[int]) -> None:
        """A group's table (:func:`~moeflow.offload.readback.pack_slot_table`) into the device table."""
        if self.ring is None:  # host memory: written in place (no tensor op, no new tensor)
            self.table.numpy()[:] = packed
        else:
            self.ring.copy(packed, self.table)

    def derive_mask(self) -> None:
        """expert_mask from the table's second half (device work: part of the captured compute)."""
        torch.ne(self.table[self.num_experts :], 0, out=self.expert_mask)


@dataclass
class Bucket:
    """One batch size's static buffers and its two captured pieces (None: not captured, run eagerly)."""

    tokens: int
    x: torch.Tensor  # [T, H] the layer's hidden state, copied in
    ids: torch.Tensor  # int32 [T, k]
    weights: torch.Tensor  # fp32 [T, k]
    out: torch.Tensor  # [T*k, H] per-pair expert outputs, filled group by group
    y: torch.Tensor  # [T, H] combined: what forward returns (valid until the next layer's combine)
    forward: Callable[[], None] | None = None  # the format's captured_forward over these buffers (made once)
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: Callable[[], None] | None = None
    combine: Callable[[], None] | None = None
    tried: bool = False  # capture attempted (captured or refused)

    def alloc(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The kernels' ``alloc``: one persistent buffer per name (shapes are fixed within a bucket)."""
        buf = self.workspace.get(name)
        if buf is None or buf.shape != torch.Size(shape) or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self.workspace[name] = buf
        return buf


class DeviceGraphs:
    """The captured device part of :class:`moeflow.offload.backend.OffloadedExperts` (see the module docstring).

    Active only inside :meth:`region` (the CUDA-graph decode step enters it around its backend calls: ``y`` is
    a static buffer it copies out at once). ``capture_factory(device)`` makes the
    :class:`moeflow.engine.cuda_graphs.GraphCapture`; ``captures``, ``replays``, ``eager_layers`` count;
    ``refused`` maps a batch size to the reason it runs eagerly; ``disabled`` is set when the backend has no
    capturable device part at all.
    """

    def __init__(self, pool: ExpertPool, num_experts: int, top_k: int, kernels_backend: str,
                 capture_factory: Callable[[torch.device], object], *, disabled: str | None = None,
                 max_buckets: int = 16) -> None:
        self.pool, self.num_experts, self.top_k = pool, num_experts, top_k
        self.device = pool.device
        # the Triton launchers, or the static torch form (also for a backend that stays eager: never run)
        self.triton = kernels.uses_triton(kernels_backend, self.device)
        self.backend = "triton" if self.triton else "torch"
        self.capture_factory = capture_factory
        self.max_buckets = max_buckets
        self.disabled = disabled
        self.capture_enabled = True  # False: the same device part from the same buffers, never replayed (tests)
        self.table = StaticSlotTable(self.device, num_experts)
        self.buckets: dict[int, Bucket] = {}
        self.refused: dict[int, str] = {}
        self.captures = self.replays = self.eager_layers = 0
        self.on = False
        self._capture = None
        self._logged: set[str] = set()
        if disabled is not None:
            self._log(f"the offload backend's device part runs eagerly: {disabled}")

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Within the block, ``OffloadedExperts.forward`` runs its device part from these buffers and graphs."""
        self.on = True
        try:
            yield
        finally:
            self.on = False

    # ------------------------------------------------------------------ per layer
    def begin_layer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Bucket | None:
        """x [T, H], topk_ids int [T, k], topk_weights fp32 [T, k] copied into the bucket of T; None: eager."""
        if not self.on or self.disabled is not None or x.shape[0] == 0:
            return None
        T = x.shape[0]
        if T in self.refused:
            self.eager_layers += 1
            return None
        bucket = self.buckets.get(T)
        if bucket is None:
            if len(self.buckets) >= self.max_buckets:
                self._refuse(T, f"batch size {T} is not a captured bucket ({self.max_buckets} are)")
                self.eager_layers += 1
                return None
            bucket = self._new_bucket(x, topk_ids)
        if x.dtype != bucket.x.dtype:
            self._refuse(T, f"activations in {x.dtype}, the bucket holds {bucket.x.dtype}")
            self.eager_layers += 1
            return None

        def copy_in() -> None:
            bucket.x.copy_(x)
            bucket.ids.copy_(topk_ids)
            bucket.weights.copy_(topk_weights)
        self._launch(copy_in)
        return bucket

    def compute(self, bucket: Bucket, experts: list[int], slots: list[int]) -> None:
        """Fill ``bucket.out``'s rows of ``experts`` (held in ``slots``): fill the table, replay (or capture)."""
        packed = pack_slot_table(experts, slots, self.num_experts)

        def group() -> None:
            self.table.fill(packed)
            if bucket.compute is not None and self.capture_enabled:
                bucket.compute()
                self.replays += 1
            elif not bucket.tried and self.capture_enabled:
                self._capture_pieces(bucket)  # runs this group too (the warm-up)
            else:
                self._compute_fn(bucket)()
        self._launch(group, slots)

    def combine(self, bucket: Bucket) -> torch.Tensor:
        """``bucket.y`` [T, H] from ``bucket.out`` (its replay once captured)."""
        def run() -> None:
            if bucket.combine is not None and self.capture_enabled:
                bucket.combine()
                self.replays += 1
            else:
                self._combine_fn(bucket)()
        self._launch(run)
        return bucket.y

    def _launch(self, work: Callable[[], None], slots: Sequence[int] = ()) -> None:
        """Enqueue device work (reading the pool's ``slots``) on the compute stream: on a GPU every op in
        ``work`` is a stream operation, so calling it is enqueueing it; the tests' emulated stream
        (tests/scripted_transport.py) queues it instead, to run it as late as the fences allow."""
        work()

    # ------------------------------------------------------------------ the two pieces
    def _compute_fn(self, bucket: Bucket) -> Callable[[], None]:
        table, pool = self.table, self.pool
        if bucket.forward is None:  # the format's static form (its kernels, their launch config, its buffers)
            bucket.forward = pool.fmt.captured_forward(pool, bucket.x, bucket.ids, bucket.weights, table.slot_of_expert,
                                                       table.expert_mask, bucket.out, self.backend, bucket.alloc)
        forward = bucket.forward

        def compute() -> None:
            table.derive_mask()
            forward()
        return compute

    def _combine_fn(self, bucket: Bucket) -> Callable[[], None]:
        k = self.top_k
        if self.triton:
            return lambda: ops.combine_eager(bucket.out, k, bucket.y)
        return lambda: bucket.y.copy_(combine_in_order(bucket.out, k))

    def _capture_pieces(self, bucket: Bucket) -> None:
        """Warm up and capture both pieces of ``bucket`` on the capture's side stream; the warm-up computes the
        current group. A refusal leaves the bucket eager (for this layer) and in ``refused`` (from the next)."""
        bucket.tried = True
        if self._capture is None:
            self._capture = self.capture_factory(self.device)
        cap = self._capture
        compute, combine = self._compute_fn(bucket), self._combine_fn(bucket)
        with cap.side_stream():
            # the warm-up: this group's rows (a capture does not run its work on a GPU), every workspace buffer
            # allocated and every kernel compiled outside the capture; the combine's output is rewritten by the
            # layer's real combine
            compute()
            combine()
            replays = []
            try:
                for piece in (compute, combine):
                    cap.begin()
                    piece()
                    replays.append(cap.end())
            except Exception as err:  # noqa: BLE001 (any refusal: this batch size runs eagerly)
                cap.abort()
                self._refuse(bucket.tokens, f"{type(err).__name__}: {err}")
                return
        bucket.compute, bucket.combine = replays
        self.captures += 1

    # ------------------------------------------------------------------ helpers
    def _new_bucket(self, x: torch.Tensor, topk_ids: torch.Tensor) -> Bucket:
        T, H = x.shape
        k, dev = self.top_k, x.device
        bucket = Bucket(T, torch.zeros_like(x), torch.zeros((T, k), dtype=torch.int32, device=dev),
                        torch.zeros((T, k), dtype=torch.float32, device=dev),
                        torch.zeros((T * k, H), dtype=x.dtype, device=dev), torch.zeros_like(x))
        check_expert_args(bucket.x, bucket.ids, bucket.weights, self.table.slot_of_expert, bucket.out,
                          self.table.expert_mask, self.pool.fmt.hidden_size)
        if self.triton:
            ops.check_triton_device(x)
        self.buckets[T] = bucket
        return bucket

    def _refuse(self, tokens: int, reason: str) -> None:
        self.refused[tokens] = reason
        self.buckets.pop(tokens, None)
        self._log(f"the offload backend's device part for batch size {tokens} runs eagerly: {reason}")

    def _log(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("moeflow: %s", message)
