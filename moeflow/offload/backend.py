"""The offloading expert backend: host store + slot cache + copy engine behind ``ExpertBackend``.

One MoE layer (``forward``), in order:

1. one device->host transfer: the experts this layer needs (plus the predictor's proposals), posted first;
   with ``early_hits`` one group over the layer's READY slots is launched before the host waits for it, so
   the device computes the hits while the host schedules (docs/design.md, "Hits launched before the read-back");
2. early preemption: this layer's stale predicted loads are dropped, the needed ones promoted;
3. acquire: resident experts are pinned (hits); missing ones get a slot and a high-priority load,
   as many as the pool allows at once, the rest wait for a slot of the ring (prefill);
4. prefetch: the predictor's guesses for later layers are queued at low priority (only when this
   layer holds no deferred experts: the ring needs every free slot);
5. reordered inference: the resident experts are computed first, in one kernel call; then the loads
   in arrival order, each call also taking whatever else has landed; each computed group releases its
   slots, which go to the deferred experts. ``out [T*k, H]`` is filled group by group and combined once,
   so the result is bitwise the one of a single resident pass.

The expert groups and the combine are the device part (:mod:`moeflow.offload.compute`), eager or replayed
from graphs captured per batch size (:mod:`moeflow.offload.device_step`, which argues the ordering). With the
decode step captured, the routing and the read-back's staging of step 1 may run in the step's captured piece
before the layer instead (:mod:`moeflow.offload.prelude`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection

import torch

from moeflow import kernels
from moeflow.compile_boundary import host_logic
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.moe.backend import ExpertBackend, KernelRouting, RoutingPathPlanner, StepInfo
from moeflow.moe.routing import Router
from moeflow.offload.cache import ExpertCache, Slot
from moeflow.offload.compute import LayerCompute
from moeflow.offload.contracts import LoadQueue, PreludeStage, SlotLoads
from moeflow.offload.copy_engine import linear_chunks
from moeflow.offload.cpu_slots import SlotInt4Forms
from moeflow.offload.device_step import DeviceGraphs
from moeflow.offload.eviction import EvictionPolicy
from moeflow.offload.host_store import HostStore
from moeflow.offload.hybrid import HybridCompute
from moeflow.offload.plan import arrival_order, plan_layer
from moeflow.offload.platform import REAL, Platform
from moeflow.offload.policies.spec import Mechanisms
from moeflow.offload.predictors.interface import Predictor
from moeflow.offload.prefetch_gate import gate_for
from moeflow.offload.prelude import PreludeCapture
from moeflow.offload.readback import ReadBack, host_proposals
from moeflow.offload.slot_loads import SlotLoader
from moeflow.offload.stats import PhaseStats, Stats
from moeflow.offload.token_groups import forward_token_groups
from moeflow.offload.transport import CudaTransport, Transport


class OffloadedExperts(ExpertBackend):
    """``ExpertBackend`` whose experts live in a :class:`HostStore` and stream into ``n_slots`` device slots.

    Built by :func:`moeflow.offload.create_expert_backend` from a policy; ``platform`` supplies the clock,
    the copy engine and (optionally) the compute executor (see :mod:`moeflow.offload.platform`).
    prefill_ring: in prefill at most this many of a layer's loads hold slots at once (DuoServe), None: no limit.
    h2d_bytes_per_s: the configured host->device rate (``OffloadConfig.h2d_gbps``) for the prefetch gate.

    Collaborators, each built here: ``loads`` (:class:`~moeflow.offload.slot_loads.SlotLoader`: the load side),
    ``prelude`` (:class:`~moeflow.offload.prelude.PreludeCapture`: the captured prelude), ``compute``
    (:class:`~moeflow.offload.compute.LayerCompute`: the device part), ``readback``, ``cache`` and ``engine``.
    """

    def __init__(
        self,
        fmt: ExpertFormat,
        *,
        top_k: int,
        n_slots: int,
        device: torch.device | str,
        host: HostStore,
        transport: Transport,
        eviction: EvictionPolicy,
        stats: Stats,
        predictor: Predictor | None = None,
        cpu: HybridCompute | None = None,
        retain: bool = True,
        warm_start: bool = True,
        per_layer: bool = False,
        prefill_ring: int | None = None,
        copy_chunks: int = 3,
        max_inflight_chunks: int = 2,
        kernels_backend: str = "torch",
        policy_name: str = "",
        owns_host: bool = True,
        platform: Platform = REAL,
        early_hits: bool | None = None,
        mechanisms: Mechanisms | None = None,
        h2d_bytes_per_s: float | None = None,
    ) -> None:
        self.fmt = fmt
        self.mechanisms = mechanisms if mechanisms is not None else Mechanisms()
        self.num_layers, self.num_experts, self.top_k = host.num_layers, host.num_experts, top_k
        self.device = torch.device(device)
        self.kernels_backend = kernels_backend
        self.policy_name = policy_name
        self.stats = stats
        self.predictor = predictor
        self.warm_start = warm_start
        self.transport = transport
        self._cuda_transport = isinstance(transport, CudaTransport)
        self.clock = platform.clock
        if host.fmt != fmt:
            raise ValueError("the given host store holds another model's experts")
        self.host = host
        self.pool = ExpertPool.allocate(fmt, n_slots, self.device)
        quota = n_slots // self.num_layers if per_layer else 0
        self.cache = ExpertCache(n_slots, eviction, retain=retain, stats=stats.current, layer_quota=quota,
                                 key_space=(self.num_layers, self.num_experts))
        self.engine: LoadQueue = platform.make_engine(transport, host, self.pool, chunks=copy_chunks,
                                                      max_inflight=max_inflight_chunks)
        if self.mechanisms.prefetch_chunks == "per-linear":  # ProMoE §5.1: a prediction moves one linear at a time
            self.engine.set_low_chunks(linear_chunks(fmt))
        self._phase = stats.phase
        self.readback = ReadBack(self.device, self.num_experts, on_wait=platform.read_wait)
        # the device part: expert groups and the combine, eager or captured (platform.compute: the simulator's)
        self.compute = LayerCompute(fmt, self.pool, self.num_experts, top_k, kernels_backend, platform.compute)
        self.cpu = cpu  # hybrid execution: misses computed on the CPU (docs/hybrid.md)
        self.early_hits = self._early_hits(early_hits)
        self.prefill_ring = prefill_ring
        self.loads: SlotLoads = SlotLoader(self.cache, self.engine, host, transport, stats, predictor=predictor,
                                           clock=self.clock, prefill_ring=prefill_ring, num_layers=self.num_layers,
                                           mechanisms=self.mechanisms, gate=gate_for(
                                               self.mechanisms.prefetch_gate, host, transport, self.device,
                                               self.clock, h2d_bytes_per_s))
        self.prelude: PreludeStage = PreludeCapture(kernels_backend, predictor, self.readback, hybrid=cpu is not None)
        if predictor is not None:
            predictor.bind(self.loads)  # predictors that prefetch outside forward (FineMoE, ExpertFlow)
        stats.expert_pool_bytes = self.pool.buffer.numel()
        stats.host_store_bytes = self.host.nbytes
        stats.host_pinned = self.host.pinned
        if self.device.type == "cuda" and not self.host.pinned:
            warnings.warn("moeflow: the expert host store is not in pinned memory: every copy goes through a staging "
                          "buffer at a fraction of the link's speed and waits for the compute stream "
                          "(OffloadConfig.pin_memory, or the OS refused to pin; see stats.host_pinned)",
                          RuntimeWarning, stacklevel=3)
        # threads and page registrations go away with the backend, even without close()
        self._finalizer = weakref.finalize(
            self, _shutdown, self.engine, self.transport, self.host if owns_host else None
        )

    def _early_hits(self, wanted: bool | None) -> bool:
        """``OffloadConfig.early_hits`` resolved: None is on where the read-back is a real wait (a CUDA device) and
        the groups run on the Triton kernels, which compute only the pairs routed to a group's experts (the torch
        backend's captured form computes every expert the group names: the early group's unrouted ones too)."""
        why_not = "kernels='cpu-int4' slots" if self.compute.int4_slots is not None else None
        if wanted and why_not:
            raise ValueError(f"OffloadConfig.early_hits=True: {why_not} computes a group only once its routing "
                             "is on the host")
        if wanted is None:
            return self.readback.cuda and why_not is None and kernels.uses_triton(self.kernels_backend, self.device)
        return bool(wanted)

    @property
    def n_slots(self) -> int:
        return self.pool.n_slots

    @property
    def int4_slots(self) -> SlotInt4Forms | None:
        """kernels="cpu-int4" on the CPU: the slots' torch int4 forms (CpuInt4Format), computed with its kernels."""
        return self.compute.int4_slots

    @property
    def device_graphs(self) -> DeviceGraphs | None:
        return self.compute.graphs

    def enable_device_graphs(self, capture_factory: Callable[[torch.device], object]) -> DeviceGraphs:
        """Capture the device part of ``forward`` per batch size, replayed inside ``DeviceGraphs.region()``
        (see :mod:`moeflow.offload.device_step`); ``capture_factory(device)`` makes the ``GraphCapture``."""
        return self.compute.enable_graphs(capture_factory)

    # ------------------------------------------------------------------ loading
    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write one expert straight into its host region (no other full copy of the model in RAM)."""
        self.host.write(layer, expert, tensors)

    def finish_loading(self) -> None:
        """Check every expert arrived; fill the pool (expert 0 of every layer, then 1, ...) for a warm start."""
        missing = self.host.missing()
        if missing:
            raise RuntimeError(f"expert host store incomplete: {len(missing)} experts never loaded, e.g. {missing[:4]}")
        if self.cpu is not None:  # CPU int4 forms + cost-model rates
            self.cpu.prepare(self.device, self.transport.name)
        if self.warm_start:
            self.loads.warm_fill(min(self.n_slots, self.num_layers * self.num_experts), self.num_layers)

    def prefetch(self, target: int, experts: list[int], layer_now: int = 0) -> list[int]:
        """Queue low-priority loads of ``target``'s ``experts`` outside ``forward`` (:meth:`SlotLoader.prefetch`);
        returns the experts queued."""
        return self.loads.prefetch(target, experts, layer_now)

    # ------------------------------------------------------------------ one pass
    def begin_step(self, step: StepInfo) -> None:
        """Keep the pass's real tokens (the base's); hand the pass to the predictor (FineMoE's semantic search,
        ExpertFlow's path plan)."""
        super().begin_step(step)
        if self.predictor is not None and (step.phase != "prefill" or self.mechanisms.predict_in_prefill):
            self.predictor.begin_step(step)

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor | None:
        return self.predictor.predict_paths(step, last_only) if self.predictor is not None else None

    @property
    def needs_history(self) -> bool:
        return self.predictor is not None and self.predictor.needs_history

    @property
    def path_planner(self) -> RoutingPathPlanner | None:
        """The predictor when it plans routing paths (expertflow's PLEC), else None."""
        return self.predictor.as_path_planner() if self.predictor is not None else None

    # ------------------------------------------------------------------ one layer
    def _route_and_forward(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor, route: Router,
                           kernel_routing: KernelRouting | None, want_ids: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the Triton path a plain softmax top-k is routed by the resident backend's fused plan kernel, so
        it is routed here by the same kernel (one launch; bitwise the resident routing); probs only for a predictor.
        Only real tokens get here (``ExpertBackend.forward_logits``): the needed-expert read-back, the predictor's
        observations, the cache's counts and the CPU-vs-copy choice never see padding. With the decode step
        captured the routing may run in the captured piece instead (:mod:`moeflow.offload.prelude`)."""
        if not self.prelude.routes_on_triton(x, kernel_routing):
            return super()._route_and_forward(layer, x, router_logits, route, kernel_routing, want_ids)
        ids, weights = kernels.route(router_logits, kernel_routing.top_k, "triton",
                                     renormalize=kernel_routing.renormalize)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32) if self.predictor is not None else None
        return self._forward_to_call()(layer, x, probs, ids, weights), ids if want_ids else None

    def capture_prelude(self, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
                        kernel_routing: KernelRouting | None) -> object | None:
        """The layer's routing and read-back staging enqueued in the captured piece (:mod:`moeflow.offload.prelude`),
        or None where the prelude is refused (:meth:`PreludeCapture.refusal`)."""
        return self.prelude.capture(layer, x, router_logits, kernel_routing)

    def forward_prelude(self, prelude: object, layer: int, x: torch.Tensor, router_logits: torch.Tensor,
                        route: Router, kernel_routing: KernelRouting | None) -> torch.Tensor:
        """The layer [T, H] from the prelude the piece just replayed (the eager ``forward_logits`` where it does
        not apply: padding in the pass, another backend's prelude)."""
        real = self._real_tokens
        padded = real is not None and real[0] is not None and real[1] == x.shape[0]
        handed = None if padded else self.prelude.hand_over(prelude, layer)
        if handed is None:
            return self.forward_logits(layer, x, router_logits, route, kernel_routing, False)[0]
        return self._forward_to_call()(layer, x, None, handed.topk_ids, handed.topk_weights)

    @host_logic  # the host-side scheduler: the one graph break per MoE layer under torch.compile
    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        probs: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, H], probs fp32 [T, E], topk_ids int32 [T, k], topk_weights fp32 [T, k] -> [T, H]."""
        return self._forward(layer, x, probs, topk_ids, topk_weights)

    def _forward(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        if self.stats.phase != self._phase:
            self._phase = self.stats.phase
            self.cache.policy.on_phase(self._phase)
        st = self.stats.current()
        k = topk_ids.shape[1]

        # 1. the layer's only blocking device->host read: its routing, and the predictor's proposals with it
        pred, captured = self._active_predictor(), self.prelude.take()
        if pred is not None and captured is None:  # routing first: predictors that learn from it (DuoServe) need it
            pred.observe(layer, x, probs, topk_ids)
        # proposed and staged in the captured piece just replayed (prelude.py): its event only
        proposals = captured.proposals if captured is not None else pred.propose(layer, x) if pred is not None else []
        on_device = [ids for _, ids in proposals if isinstance(ids, torch.Tensor)]
        host_routing = pred is not None and pred.host_routing
        if captured is not None:
            self.readback.post_captured(topk_ids, on_device)
        else:  # the predictor searching on the host gets the routing in the same read
            self.readback.post(topk_ids, [*on_device, topk_ids] if host_routing else on_device,
                               [probs] if host_routing else [])
        groups = pred.token_groups() if pred is not None else None  # ExpertFlow §3.3 in prefill (token_groups.py)
        grouped = groups is not None and len(groups) > 1
        early_hits = self.early_hits and not grouped
        out, early = self._launch_early(layer, x, topk_ids, topk_weights) if early_hits else (None, ())
        needed, fetched, floats = self.readback.collect()
        if host_routing:
            top_host = torch.tensor(fetched.pop(), dtype=torch.int64).view(topk_ids.shape)
        guesses = host_proposals(proposals, fetched)
        if host_routing:
            pred.observe_host(layer, floats[0], top_host)

        try:
            if grouped:
                y = forward_token_groups(self, layer, x, topk_ids, topk_weights, needed, guesses, st, groups)
            else:
                out = self._schedule_and_compute(layer, x, topk_ids, topk_weights, needed, guesses, st, out, early)
        except BaseException:
            self.compute.abort()
            # an interrupted layer (kernel error, Ctrl-C) must not leave slots pinned for good
            if self.cpu is not None:
                self.cpu.abort()
            fence = self.transport.compute_fence()
            for slot in self.cache.slots:
                if slot.in_use:
                    slot.pins = 1
                    self.cache.release(slot, fence)
            raise
        if self._cuda_transport:
            st.stall_s += self.transport.collect_stall_s()
        return y if grouped else self.compute.combine(out, k)

    def _schedule_and_compute(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        needed: list[int],
        guesses: list[tuple[int, list[int]]],
        st: PhaseStats,
        out: torch.Tensor | None = None,
        early: Collection[int] = (),
        gate: bool = True,
    ) -> torch.Tensor:
        """Steps 2-5 of the module docstring; returns the uncombined ``out [T*k, H]`` (given when the early group
        already filled the rows of ``early``: the hits are pinned and released as ever, computed once). ``gate``
        False: step 2 already ran for the layer (token_groups.py runs it once, before its token micro-batches)."""
        # 2. early preemption
        self.cache.poll()
        if gate:
            self.gate_layer(layer, needed)

        # 3. acquire: the plan from the cache's state, then the hits pinned and the loads under way promoted
        lookup = self.cache.lookup
        plan = plan_layer(layer, needed, lookup)
        access, use = self.cache.policy.access, self.cache.use
        for e in needed:
            key = (layer, e)
            access(key)
            slot = lookup(key)
            if slot is not None:
                use(slot)
        st.hits += plan.hits()
        st.misses += len(plan.deferred)
        st.inflight_hits += len(plan.waiting)
        for task in plan.waiting:
            self.engine.promote(task)
        if self.cpu is not None:  # the cost model sends some misses to the CPU workers
            plan.move_to_cpu(self.cpu.start_layer(layer, x, topk_ids, topk_weights, list(plan.deferred),
                                                  plan.waiting, self.engine.high_backlog(), st))
        ready, deferred = plan.ready, plan.deferred
        self.host.stage_all(layer, deferred)  # disk tier: read every miss at once, not one per copy
        waiting = arrival_order(plan.waiting)
        self.loads.load_deferred(layer, deferred, waiting, st)

        # 4. prefetch for later layers
        if not deferred:
            for target, ids in guesses:
                self.loads.prefetch_guesses(target, ids, layer, st)
        self.loads.pump(st)

        # 5. reordered inference
        if out is None:
            out = self.compute.begin_layer(x, topk_ids, topk_weights)  # static when the device part is captured
        late = self._active_predictor() is not None and self.predictor.proposes_late
        if ready:
            self._compute(layer, x, topk_ids, topk_weights, out, ready, done=early)
            if late:
                late = self.loads.late_prefetch(layer, deferred, st)
            if deferred:  # the slots just released go to the ring
                self.loads.load_deferred(layer, deferred, waiting, st)
                self.loads.pump(st)
        while waiting:
            if self.cpu is not None and self.cpu.racing:  # a load whose CPU twin finished first is not computed
                waiting = self.cpu.settle(waiting, out, st, self.loads.release_unread)
                self.loads.load_deferred(layer, deferred, waiting, st)
                if not waiting:
                    continue
            group = [waiting.pop(0)]
            group += [t for t in waiting if t.complete()]
            waiting = [t for t in waiting if t not in group]
            if self.cpu is not None:
                self.cpu.discard_races([t.expert for t in group])
            for task in group:
                self.loads.wait(task, st)
            self._compute(layer, x, topk_ids, topk_weights, out, [t.expert for t in group])
            self.loads.load_deferred(layer, deferred, waiting, st)
            if late:
                late = self.loads.late_prefetch(layer, deferred, st)
            self.loads.pump(st)
        if late:
            self.loads.late_prefetch(layer, deferred, st)
        if deferred:  # cannot happen with n_slots >= 1: every computed group frees its slots
            raise RuntimeError(f"layer {layer}: experts {list(deferred)} never got a slot")
        if self.cpu is not None:
            self.cpu.finish(out, st)
        return out

    def gate_layer(self, layer: int, needed: list[int]) -> None:
        """Step 2: the layer's routing is known, its stale predicted loads dropped and the needed ones promoted."""
        _, dropped = self.engine.preempt(layer, set(needed))
        self.loads.layer_gate(layer, needed)
        for task in dropped:
            self.cache.drop(self.cache.lookup(task.key), task.fences())

    def _active_predictor(self) -> Predictor | None:
        """The predictor, unless the phase runs without one (``Mechanisms.predict_in_prefill``: DuoServe's prefill)."""
        if self._phase == "prefill" and not self.mechanisms.predict_in_prefill:
            return None
        return self.predictor

    # ------------------------------------------------------------------ compute helpers
    def _launch_early(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                      ) -> tuple[torch.Tensor, frozenset[int]]:
        """Before the routing reaches the host: the layer's ``out`` and one group over every expert of the layer
        in a READY slot (the kernels compute the pairs the device's routing sends there), fenced; returns
        (out, those experts). The schedule then pins and releases the hits as ever and computes only the rest.
        No slot of this group can be evicted before the schedule pins its hits (nothing allocates in between)."""
        out = self.compute.begin_layer(x, topk_ids, topk_weights)
        experts, slots = self.cache.ready_in(layer)
        if not experts:
            return out, frozenset()
        self.compute.compute(layer, x, topk_ids, topk_weights, out, experts, slots)
        fence = self.transport.compute_fence()
        for index in slots:  # unrouted experts' slots too: the group's table names them
            self.cache.fence(self.cache.slots[index], fence)
        return out, frozenset(experts)

    def _compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor, experts: list[int], done: Collection[int] = ()) -> None:
        """Fill ``out`` rows of ``experts`` (but ``done``: the early group's) from their slots, then release the
        slots behind a compute fence."""
        slots = [self.cache.lookup((layer, e)) for e in experts]
        todo = [(e, slot.index) for e, slot in zip(experts, slots, strict=True) if e not in done]
        if todo:
            self.compute.compute(layer, x, topk_ids, topk_weights, out, [e for e, _ in todo], [i for _, i in todo])
        self._release_after_compute(slots)

    def _release_after_compute(self, slots: list[Slot]) -> None:
        fence = self.transport.compute_fence()
        for slot in slots:
            self.cache.release(slot, fence)

    # ------------------------------------------------------------------ lifetime
    def synchronize(self) -> None:
        """Wait for every queued and in-flight copy (tests, benchmarks)."""
        self.loads.synchronize()

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
        if self.predictor is not None:
            self.predictor.close()
        self._finalizer()

    def __repr__(self) -> str:
        return (f"OffloadedExperts(policy={self.policy_name!r}, slots={self.n_slots}/"
                f"{self.num_layers * self.num_experts}, transport={self.transport.name!r}, "
                f"eviction={self.cache.policy.name!r}, pinned={self.host.pinned})")


def _shutdown(engine: LoadQueue, transport: Transport, host: HostStore | None) -> None:
    engine.close()
    transport.synchronize()
    transport.close()
    if host is not None:
        host.close()
