"""The decode step as CUDA graphs (``from_pretrained``'s ``cuda_graphs``: on by default on CUDA), piecewise around the
expert backend.

Between two calls into a host-side expert backend (the offload scheduler: its one read-back, its plan, its
copies) a decode step's device work has static shapes and never waits for the host, so it is captured once
and replayed every step:

    piece 0:  rotary, masks, layer 0 up to its gate [+ prelude 0] | backend.forward_logits(0, x, router_logits, ...)
    piece 1:  layer 0 after its experts, layer 1 to its gate [+ prelude 1] | backend.forward_logits(1, ...)
    ...
    piece L:  the last layer after its experts, final norm, LM head  -> logits

A piece may end with the backend's *prelude* of the layer (``ExpertBackend.capture_prelude``: device work that
needs no host value; the offload backend's routing launch and read-back staging on the Triton path,
:mod:`moeflow.offload.prelude`); the call between the pieces is then ``backend.forward_prelude(prelude, ...)``,
which consumes its static outputs (records the read-back's event, waits, schedules, runs the device part).

The pieces are found by running the decode function once with a stand-in backend (:class:`_Boundary`) that,
at each MoE call, enqueues the real backend's prelude (if it has one), ends the capture in progress, keeps the
call's tensors (the static arguments of the real call at replay; without a prelude the routing runs in the
backend's call, which may fuse it into its kernels), and starts the next piece on a static buffer that the real
call's output is copied into.
A backend dynamo traces through (every expert resident: pure device work) needs no boundary: one graph.

Inside a backend call, the offload backend's own device part (the expert groups over the slot pool and the
combine, after its read-back and schedule) is captured too, once per batch size, and replayed for every layer
(:mod:`moeflow.offload.device_step`): the step replays its pieces inside the backend's
``device_graphs.region()``, which makes ``forward`` run from static buffers whose output is copied out at once.

Graphs bake in the addresses of the KV cache they were captured with and of the batch's shapes, so a step is
captured only on a *capturable* cache: one with a ``graph_owner`` (the object whose memory the graphs read and
write), kept across passes. ``generate``'s :class:`~moeflow.engine.kv_cache.StaticKVCache` is its own owner: the
runner keeps it across calls, its length rounded up to a bucket of 256 positions
(:func:`moeflow.engine.generate.cache_length`), so only a call in another bucket or with another batch size captures
again; prompt lookup's drafted passes (:mod:`moeflow.engine.lookup`) are a second step on the same cache, 1 +
prompt_lookup_num_tokens tokens wide. The serving engine's :class:`~moeflow.engine.kv_slots.SlotDecodeView` (one per
padded batch size and key-length bucket, owned by its slotted cache) gets one captured step each, and so does prompt
lookup's :class:`~moeflow.engine.slot_verify.SlotVerifyView` (one per key-length bucket, same owner), several kept at
once (at most ``max_steps``, the least recently used dropped first); a capture on another owner drops the steps of
the old one (its cache is gone: generate's old cache, or a generate call between serving passes). Views made anew
every pass (micro-batches' row views, the engine's eager :class:`~moeflow.engine.kv_slots.SlotBatch`) run eagerly. A
capture the device refuses (an op that syncs, a host tensor copied in, ...) is logged once and the step runs eagerly
from then on (``CudaGraphDecode.refused`` says why).
How a piece is captured is a :class:`GraphCapture`: :class:`CudaCapture` on a GPU; the tests give one that
records and replays the pieces' ops on the CPU.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from moeflow.compile_boundary import host_logic
from moeflow.engine.compiled import traces_through
from moeflow.engine.kv_cache import PassCache
from moeflow.engine.memory import GRAPH_STEPS
from moeflow.moe.backend import DevicePart, ExpertBackend, KernelRouting
from moeflow.moe.block import RoutingRecorder

log = logging.getLogger(__name__)

DecodeFn = Callable[..., torch.Tensor]  # (embeds, positions, cache, cache_position, token_mask, experts, routing)


def graphs_wanted(cuda_graphs: bool | None, device: torch.device) -> bool:
    """``from_pretrained``'s ``cuda_graphs``: None (default) is on for a CUDA device and off elsewhere; True
    asks for them (ValueError off CUDA); False is off."""
    if cuda_graphs is None:
        return device.type == "cuda"
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs device='cuda'; this model is on {device}")
    return bool(cuda_graphs)


class GraphCapture(Protocol):
    """Captures pieces one after the other: ``begin()`` ... ``end()`` -> the piece's replay."""

    def begin(self) -> None: ...
    def end(self) -> Callable[[], None]: ...
    def abort(self) -> None: ...
    def side_stream(self) -> contextlib.AbstractContextManager: ...


class CudaCapture:
    """Pieces as ``torch.cuda.CUDAGraph``s sharing one memory pool, captured on a side stream; only this
    thread's CUDA calls are checked during capture (the copy engine's threads keep working)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> Callable[[], None]:
        graph, self._graph = self._graph, None
        graph.capture_end()
        return graph.replay

    def abort(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            with contextlib.suppress(Exception):  # the capture is already invalid: end it, keep the first error
                graph.capture_end()

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)


@dataclass
class _Call:
    """One MoE layer's call into the backend, as captured: static arguments and the output buffer."""

    layer: int
    x: torch.Tensor  # [T, H]
    router_logits: torch.Tensor  # [T, E]: the block's gate output (in the graph); routing runs in the backend
    route: Callable  # the block's router (logits -> probs, ids, weights)
    kernel_routing: KernelRouting | None
    out: torch.Tensor  # [T, H]: the real call's output, copied in before the next piece
    prelude: object | None = None  # the backend's captured prelude of the layer (capture_prelude), in the piece before


class _Boundary:
    """Stands in for the expert backend while the pieces are captured: each ``forward`` ends a piece. Without
    a capture (the warm-up) it returns zeros: the warm-up only runs every kernel once, with the same types
    (a compiled decode function then needs nothing new while the capture runs)."""

    def __init__(self, capture: GraphCapture | None, experts: ExpertBackend | None = None) -> None:
        self.capture = capture
        self.experts = experts  # the real backend, whose prelude ends each piece
        self.replays: list[Callable[[], None]] = []
        self.calls: list[_Call] = []

    @host_logic  # host logic (a compiled decode function breaks here, as at the real backend)
    def forward_logits(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor, route: Callable,
                       kernel_routing: KernelRouting | None, want_ids: bool) -> tuple[torch.Tensor, None]:
        if want_ids:  # a recorded routing would be a host value of the captured step
            raise RuntimeError("the decode step records its routing (tracing): CUDA-graph pieces do not return it")
        experts = self.experts
        prelude = experts.capture_prelude(layer, x, router_logits, kernel_routing) if experts is not None else None
        if self.capture is None:
            return torch.zeros_like(x), None
        self.replays.append(self.capture.end())
        # allocated between captures: the graphs only read it; zeros, not garbage: a capture that runs its work
        # (the tests' stand-in) computes on finite values, so a prelude's routing stays in range
        out = torch.zeros_like(x)
        self.calls.append(_Call(layer, x, router_logits, route, kernel_routing, out, prelude))
        self.capture.begin()
        return out, None


@dataclass
class CapturedStep:
    """One captured decode step: ``inputs`` (static copies of embeds, positions, cache_position, token_mask),
    the pieces' replays, the backend calls between them, and the static logits the last piece writes."""

    cache: PassCache  # the KV cache the graphs write (held so its tensors, and its identity, stay)
    inputs: tuple[torch.Tensor, ...]
    replays: list[Callable[[], None]]
    calls: list[_Call]
    logits: torch.Tensor
    capture: GraphCapture | None = None  # the GraphCapture (its memory pool) the pieces were captured with

    def run(self, experts: ExpertBackend, device_part: DevicePart | None = None) -> torch.Tensor:
        """Replay every piece, the backend's real calls in between (inside ``device_part.region()``, the
        backend's captured device part, when given); returns the static logits [B, T, V]."""
        with device_part.region() if device_part is not None else contextlib.nullcontext():
            for i, replay in enumerate(self.replays):
                replay()
                if i < len(self.calls):
                    c = self.calls[i]
                    if c.prelude is not None:  # the layer's routing and read-back staging ran in the replay
                        out = experts.forward_prelude(c.prelude, c.layer, c.x, c.router_logits, c.route,
                                                      c.kernel_routing)
                    else:
                        out = experts.forward_logits(c.layer, c.x, c.router_logits, c.route, c.kernel_routing,
                                                     False)[0]
                    c.out.copy_(out)  # at once: a captured device part's output is overwritten by the next layer
        return self.logits


def capture_step(fn: DecodeFn, capture: GraphCapture, inputs: tuple[torch.Tensor, ...], cache: PassCache,
                 experts: ExpertBackend) -> CapturedStep:
    """Warm ``fn`` up once, then capture it piecewise around ``experts`` (whole when dynamo traces it).

    A cache whose step is not idempotent (linear-attention states advance on every run: ``cache.snapshot()``)
    is put back as it was after the warm-up and the capture, so the first replay (or the eager step, when the
    capture is refused) advances it once."""
    embeds, positions, cache_position, token_mask = inputs
    whole = traces_through(experts)
    restore = cache.snapshot()
    with capture.side_stream():
        try:
            fn(embeds, positions, cache, cache_position, token_mask, experts if whole else _Boundary(None, experts),
               None)
            boundary = None if whole else _Boundary(capture, experts)
            capture.begin()
            try:
                logits = fn(embeds, positions, cache, cache_position, token_mask, experts if whole else boundary,
                            None)
                last = capture.end()
            except BaseException:
                capture.abort()
                raise
        finally:
            restore()
    replays = [*boundary.replays, last] if boundary is not None else [last]
    return CapturedStep(cache, inputs, replays, boundary.calls if boundary is not None else [], logits, capture)


class CudaGraphDecode:
    """A ``Runner.decode_fn`` that replays the captured step of ``inner`` (the decoder, or its compiled form).

    ``capture_factory``: makes the :class:`GraphCapture` (default :class:`CudaCapture` on the inputs' device),
    a fresh one (a fresh memory pool) per captured step.
    ``capture_experts``: also capture the offload backend's device part (``enable_device_graphs``; its own
    ``refused`` / ``disabled`` say where it stays eager).
    ``max_steps``: captured steps kept at once (one per capturable cache, batch shape and dtype).
    The logits returned are the step's static buffer, overwritten by the next replay of that step (callers read
    them before). ``captures`` counts captures, ``replays`` the calls that ran a captured step, ``eager_calls``
    those that ran ``inner`` instead (refused, a recorded routing, a cache view without owner); ``refused`` holds
    the reason capture was given up, if it was; ``step`` is the step replayed last.
    """

    def __init__(self, inner: DecodeFn, capture_factory: Callable[[torch.device], GraphCapture] | None = None,
                 capture_experts: bool = True, max_steps: int = GRAPH_STEPS):
        self.inner = inner
        self.capture_factory = capture_factory or CudaCapture
        self.capture_experts = capture_experts
        self.max_steps = max_steps
        self.steps: collections.OrderedDict[tuple, CapturedStep] = collections.OrderedDict()  # least recent first
        self.step: CapturedStep | None = None
        self.captures = self.replays = self.eager_calls = 0
        self.refused: str | None = None
        self._capture: GraphCapture | None = None

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, cache: PassCache, cache_position: torch.Tensor,
                 token_mask: torch.Tensor, experts: ExpertBackend, routing: RoutingRecorder | None = None
                 ) -> torch.Tensor:
        owner = cache.graph_owner  # None: not capturable (a view made anew every pass)
        if self.refused is not None or routing is not None or owner is None:
            self.eager_calls += 1
            return self.inner(embeds, positions, cache, cache_position, token_mask, experts, routing)
        given = (embeds, positions, cache_position, token_mask)
        key = (id(cache), tuple(embeds.shape), embeds.dtype, traces_through(experts))
        step = self.steps.get(key)
        if step is None or step.cache is not cache:
            step = self._capture_new(key, owner, given, cache, experts)
            if step is None:
                self.eager_calls += 1
                return self.inner(embeds, positions, cache, cache_position, token_mask, experts, routing)
        else:
            for static, value in zip(step.inputs, given, strict=True):
                static.copy_(value)
        self.steps.move_to_end(key)
        self.step = step
        self.replays += 1
        return step.run(experts, self._device_part(experts))

    def _capture_new(self, key: tuple, owner: object, given: tuple[torch.Tensor, ...], cache: PassCache,
                     experts: ExpertBackend) -> CapturedStep | None:
        """Capture a step for ``key`` (dropping other owners' steps and the least recent beyond ``max_steps``);
        None when the device refuses (then ``refused`` is set and every later step runs eagerly)."""
        embeds = given[0]
        drop = [k for k, s in self.steps.items() if s.cache.graph_owner is not owner or k == key]
        keep = len(self.steps) - len(drop)
        drop += [k for k in self.steps if k not in drop][: max(0, keep - self.max_steps + 1)]
        if drop:
            if embeds.is_cuda:  # the old graphs' buffers may still be read: let them finish
                torch.cuda.synchronize(embeds.device)
            for k in drop:
                if self.steps[k] is self.step:
                    self.step = None
                del self.steps[k]
            if embeds.is_cuda:
                torch.cuda.empty_cache()  # the dropped pools' memory back to the device
        # a fresh capture (a fresh memory pool) per step: torch's allocator refuses a capture into a pool whose
        # graphs are all gone (CUDACachingAllocator asserts use_count > 0), which is what dropping a step does
        self._capture = self.capture_factory(embeds.device)
        try:
            step = capture_step(self.inner, self._capture, tuple(t.clone() for t in given), cache, experts)
        except Exception as err:  # noqa: BLE001 (any refusal: the step runs eagerly instead)
            self.refused = f"{type(err).__name__}: {err}"
            log.warning("CUDA-graph capture of the decode step refused; decoding eagerly from now on (%s)",
                        self.refused)
            return None
        self.captures += 1
        self.steps[key] = step
        return step

    def _device_part(self, experts: ExpertBackend | None) -> DevicePart | None:
        """The backend's captured device part (``moeflow.offload.device_step.DeviceGraphs``), or None."""
        if not self.capture_experts or experts is None:
            return None
        return experts.enable_device_graphs(self.capture_factory)
