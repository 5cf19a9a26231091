"""Hybrid execution: missed experts computed on the CPU (AWQ on int4 kernels; MXFP4 on its stored blocks,
:mod:`moeflow.kernels.cpu.mxfp4_native`; GGUF likewise) while the device computes the rest.

:class:`HybridCompute` is an executor the backend hands each layer's misses and loads under way: it decides
which missing experts are copied, computed on the CPU, or both (:mod:`.cost_model`), runs the CPU ones on a
worker thread pool, and writes their rows of the layer's ``out [T*k, H]`` before the one ``combine``. It
holds no reference to the backend: the host store's CPU forms, the copy queue's backlog and the loads come in
as arguments, and the experts it takes are returned (the caller's plan moves them, see
:meth:`~moeflow.offload.plan.LayerPlan.move_to_cpu`). Experts computed on the device keep the bitwise staging
property; CPU rows differ from the device's by the int4 kernel's bf16 rounding
(see ``docs/hybrid.md`` for the tolerance).

The CPU form of each expert comes from the host store (:meth:`HostStore.cpu_expert`): views of its region where
the CPU kernels read the stored layout (GGUF and MXFP4 blocks: no extra RAM), else converted for every expert when
loading finishes (``prepare``; AWQ 1.02x the expert's bytes, MXFP4 without moeflow's C kernels 2.35x), so no miss
ever pays a conversion.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from moeflow.config import OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.kernels.formats import ExpertFormat
from moeflow.offload.calibration import calibration_key, measure_cpu, measure_h2d, resolve_rates
from moeflow.offload.copy_engine import LoadTask
from moeflow.offload.cost_model import Candidate, Choice, Rates, plan
from moeflow.offload.eviction import EvictionPolicy, PriorityEviction, Static
from moeflow.offload.host_store import HostStore
from moeflow.offload.policies.spec import PolicySpec
from moeflow.offload.stats import PhaseStats

RACE_POLL_S = 1e-4  # how often a race is checked while neither side has finished


def resolve_cpu_compute(config: OffloadConfig, spec: PolicySpec, fmt: ExpertFormat) -> str:
    """The effective mode ("never" / "auto" / "always") for ``config`` under policy ``spec``.

    Raises SchedulingError when the policy needs CPU compute (fiddler) and cannot have it; otherwise falls
    back to "never" with one warning when the experts are neither plain AWQ nor MXFP4, or torch lacks the int4
    CPU kernels.
    """
    from moeflow.kernels.cpu.int4 import int4_cpu_available

    policy_mode = spec.cpu_compute
    mode = requested_cpu_compute(config, spec)
    if mode == "never":
        return "never"
    problem = fmt.cpu_unsupported()  # AWQ (moeflow.kernels.cpu.int4) or MXFP4 (moeflow.kernels.cpu.mxfp4)
    if problem is None and not int4_cpu_available():
        problem = f"torch {torch.__version__} lacks the int4 CPU kernels (_weight_int4pack_mm_for_cpu)"
    if problem is None:
        return mode
    if policy_mode is not None:
        raise SchedulingError(f"policy {spec.name!r} computes experts on the CPU, but {problem}")
    warnings.warn(
        f"moeflow: cpu_compute={mode!r} needs experts with a CPU form (AWQ, MXFP4, GGUF Q8_0/K-quants), but {problem}; "
        "every expert is computed on the device (cpu_compute='never')", RuntimeWarning, stacklevel=3,
    )
    return "never"


def requested_cpu_compute(config: OffloadConfig, spec: PolicySpec) -> str:
    """The mode ("never" / "auto" / "always") ``config`` and policy ``spec`` ask for, before the checks of the
    experts' format and the CPU kernels (:func:`resolve_cpu_compute`; the simulator models the kernels by a
    profile and takes this one). Raises SchedulingError when the policy needs CPU compute and the config
    forbids it."""
    policy_mode = spec.cpu_compute
    if policy_mode is not None and config.cpu_compute == "never":
        raise SchedulingError(
            f"policy {spec.name!r} computes the experts it does not place on the device on the CPU; it cannot run "
            "with cpu_compute='never' (use a caching policy such as 'static' for that)"
        )
    mode = config.cpu_compute or policy_mode or "never"
    return "never" if mode == "never" or not spec.offload else mode


def real_hybrid(config: OffloadConfig, spec: PolicySpec, fmt: ExpertFormat, host: HostStore,
                keep_on_device: Callable[[tuple[int, int]], bool]) -> HybridCompute | None:
    """``Platform.hybrid`` of the real runtime: a :class:`HybridCompute` where :func:`resolve_cpu_compute` allows
    CPU compute, else None."""
    mode = resolve_cpu_compute(config, spec, fmt)
    return HybridCompute(mode, config, host, keep_on_device) if mode != "never" else None


def release_freed_heap() -> bool:
    """Hand the heap memory freed since the last call back to the kernel (glibc's ``malloc_trim``); False where
    the C library has none. Converting every expert's CPU form (:meth:`HybridCompute.prepare`) frees a
    conversion's temporaries per expert, and glibc keeps them (its mmap threshold grows after the first large
    free, so later temporaries come from the heap): without it the process kept 4.1x an MXFP4 expert's bytes
    per converted expert instead of the form's 2.35x, 1.9x instead of 1.02x for AWQ
    (``benchmarks/results/cpu_form_rss/``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl without malloc_trim)
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def fixed_set(eviction: EvictionPolicy) -> Callable[[tuple[int, int]], bool]:
    """Whether a static placement (``Static.fixed``, possibly wrapped in a ``PriorityEviction``) wants ``key``
    on the device (never, for other policies or before the placement is fixed)."""
    def keep(key: tuple[int, int]) -> bool:
        policy = eviction
        while isinstance(policy, PriorityEviction):
            policy = policy.base
        return isinstance(policy, Static) and policy.fixed is not None and key in policy.fixed
    return keep


class HybridCompute:
    """Cost model + CPU worker pool over one host store (see the module docstring)."""

    def __init__(self, mode: str, config: OffloadConfig, host: HostStore,
                 keep_on_device: Callable[[tuple[int, int]], bool] | None = None):
        if mode not in ("auto", "always"):
            raise ValueError(f"HybridCompute mode {mode!r}: expected 'auto' or 'always'")
        self.mode = mode
        self.config = config
        self.workers = config.cpu_workers
        self.race_margin = config.race_margin
        self.keep_on_device = keep_on_device or (lambda key: False)
        self.rates: Rates | None = None
        self.rates_source = ""
        self.build_s = 0.0  # time converting every expert to the CPU int4 form
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="moeflow-cpu-expert")
        self._lock = threading.Lock()  # CPU seconds are added from the worker threads
        self.host = host  # the experts' CPU int4 forms (HostStore.cpu_expert)
        self._layer = -1
        self._jobs: dict[int, tuple[Future, torch.Tensor]] = {}  # expert -> (CPU result, its pair indices)
        self._race: set[int] = set()  # experts of the current layer also being copied
        self._counts: list[int] = []  # the current layer's tokens per expert
        self._starts: dict[tuple[int, int], float] = {}  # (layer, expert) -> when its CPU job started (workers)
        self._orphans: list[tuple[Future, float]] = []  # lost races still running: (job, estimated end)

    # ------------------------------------------------------------------ set-up
    def prepare(self, device: torch.device, transport_name: str) -> None:
        """Convert every expert to the CPU int4 form (kept in the host store) and get the cost model's rates.

        Called by the backend when loading finished (the H2D measurement copies one expert region into a
        scratch buffer on ``device``).
        """
        host = self.host
        t0 = time.perf_counter()
        for layer in range(host.num_layers * (not host.on_disk)):  # the disk tier converts on use
            for expert in range(host.num_experts):
                host.cpu_expert(layer, expert)
        if host.cpu_nbytes:
            release_freed_heap()
        self.build_s = time.perf_counter() - t0
        key = calibration_key(host.fmt, device, transport=transport_name, pinned=host.pinned, workers=self.workers)
        self.rates, self.rates_source = resolve_rates(self.config, key, lambda: self._measure(device))

    def _measure(self, device: torch.device) -> Rates:
        src = self.host.buffer[0]
        h2d = measure_h2d(src, torch.empty_like(src, device=device))
        one, per_token, free = measure_cpu(self.host.cpu_expert(0, 0), self.host.fmt.hidden_size,
                                           lambda fn: self.pool.submit(fn).result())
        return Rates(h2d, one, per_token, free)

    # ------------------------------------------------------------------ one layer
    def start_layer(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        misses: list[int],
        waiting: list[LoadTask],
        backlog: list[tuple[LoadTask, int]],
        st: PhaseStats,
    ) -> list[int]:
        """Plan the layer's ``misses`` and loads under way (``waiting``) and start the CPU jobs.

        backlog: the copy queue's high-priority loads in landing order with their bytes still to issue
        (``CopyEngine.high_backlog``). Returns the misses computed only on the CPU (they need no slot);
        racing experts are also copied.
        """
        self._layer, self._jobs, self._race = layer, {}, set()
        if not misses and not waiting:
            return []
        # the routing on the host (right after the layer's routing sync, so this waits for little)
        flat_ids = topk_ids.reshape(-1).to("cpu", torch.int64)
        counts = torch.bincount(flat_ids, minlength=self.host.num_experts).tolist()
        self._counts, self._starts = counts, {}
        choices = self.decide(layer, counts, misses, waiting, backlog)
        on_cpu = [e for e, c in choices.items() if c is not Choice.COPY]
        if not on_cpu:
            return []
        x_h = x.detach().to("cpu")
        flat_w = topk_weights.reshape(-1).to("cpu", torch.float32)
        k = topk_ids.shape[1]
        for e in sorted(on_cpu, key=lambda e: -counts[e]):  # longest first: the pool's tail is shorter
            pairs = torch.nonzero(flat_ids == e).squeeze(1)
            fut = self.pool.submit(self._job, layer, e, x_h, pairs, k, flat_w, st)
            self._jobs[e] = (fut, pairs)
            if choices[e] is Choice.BOTH:
                self._race.add(e)
                st.cpu_races += 1
        return [e for e, c in choices.items() if c is Choice.CPU]

    def decide(self, layer: int, counts: list[int], misses: list[int], waiting: list[LoadTask],
               backlog: list[tuple[LoadTask, int]]) -> dict[int, Choice]:
        """The cost model's choice (:func:`~moeflow.offload.cost_model.plan`) for each of the layer's ``misses`` and
        loads under way, ``counts[e]`` tokens routed to expert e (the simulator makes the same decision)."""
        ahead, landed_after = 0, {}
        for t, nbytes in backlog:  # the high queue drains in order: a queued load lands after everything before it
            ahead += nbytes
            landed_after[t] = ahead
        cands = [Candidate(e, counts[e], self.host.fmt.nbytes, keep_on_device=self.keep_on_device((layer, e)))
                 for e in misses]
        cands += [Candidate(t.expert, counts[t.expert], landed_after.get(t, 0), loading=True) for t in waiting]
        return plan(cands, self.rates, mode=self.mode, backlog_bytes=ahead, cpu_workers=self.workers,
                    race_margin=self.race_margin, cpu_busy_s=self.cpu_busy())

    def cpu_busy(self) -> list[float]:
        """Seconds each CPU job still running from an earlier layer (a race the copy won after the job started)
        has left, by the cost model's estimate from its start."""
        now = time.perf_counter()
        self._orphans = [(f, end) for f, end in self._orphans if not f.done()]
        return [max(0.0, end - now) for _, end in self._orphans]

    def _drop_job(self, e: int) -> None:
        """The device computes expert e: cancel its CPU job; one already running is remembered (it holds a worker
        until its end, which the next layers' plans count)."""
        fut = self._jobs.pop(e)[0]
        if fut.cancel() or fut.done():
            return
        with self._lock:
            start = self._starts.get((self._layer, e), time.perf_counter())
        self._orphans.append((fut, start + self.rates.cpu_time(self._counts[e])))

    def _job_done(self, e: int) -> bool:
        """Whether expert e's CPU job has finished (the simulator: on its virtual clock)."""
        return self._jobs[e][0].done()

    def _wait_race(self, task: LoadTask, e: int) -> None:
        """Block until expert e's CPU job finishes or ``task`` (its copy) lands, whichever is first."""
        fut = self._jobs[e][0]
        while not (fut.done() or task.complete()):
            wait_futures([fut], timeout=RACE_POLL_S)

    def _job(self, layer: int, e: int, x_h: torch.Tensor, pairs: torch.Tensor, k: int, flat_w: torch.Tensor,
             st: PhaseStats) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._lock:
            self._starts[(layer, e)] = t0
        y = self.host.cpu_expert(layer, e).forward(x_h[pairs // k], flat_w[pairs])
        with self._lock:
            st.cpu_s += time.perf_counter() - t0
        return y

    @property
    def racing(self) -> bool:
        return bool(self._race)

    def settle(
        self, waiting: list[LoadTask], out: torch.Tensor, st: PhaseStats, release: Callable[[LoadTask], None]
    ) -> list[LoadTask]:
        """Resolve races among ``waiting`` (loads of the current layer, in the order they will be computed).

        A load whose CPU twin finished first is dropped from the list (``release`` unpins its slot and cancels
        the copy's chunks still queued; one fully issued lands and stays cached) and its CPU rows are written; a
        load that landed first cancels its CPU twin. When the head of the list is racing, blocks until one of
        the two finishes.
        """
        keep: list[LoadTask] = []
        for task in waiting:
            e = task.expert
            if task.layer != self._layer or e not in self._race:
                keep.append(task)
                continue
            if not keep:  # head of the queue: nothing else to do meanwhile
                self._wait_race(task, e)
            if self._job_done(e) and not task.complete():
                self._race.discard(e)
                self._write(e, out, st)
                st.cpu_race_wins += 1
                release(task)
            elif task.complete():
                self._race.discard(e)
                self._drop_job(e)  # the device computes it; a running CPU job's result is dropped
                keep.append(task)
            else:
                keep.append(task)
        return keep

    def discard_races(self, experts: list[int]) -> None:
        """The device computed ``experts`` (their loads were taken in a group): their CPU results are not used."""
        for e in experts:
            if e in self._race:
                self._race.discard(e)
                self._drop_job(e)

    def finish(self, out: torch.Tensor, st: PhaseStats) -> None:
        """Write every remaining CPU result into ``out`` (blocks for the ones still running)."""
        for e in list(self._jobs):
            self._write(e, out, st)
        self._jobs, self._race = {}, set()

    def _write(self, e: int, out: torch.Tensor, st: PhaseStats) -> None:
        fut, pairs = self._jobs.pop(e)
        y = fut.result()
        dev = out.device
        out.index_copy_(0, pairs.to(dev, non_blocking=True), y.to(dev, out.dtype, non_blocking=True))
        st.cpu_experts += 1

    def abort(self) -> None:
        """An interrupted layer: drop its CPU work."""
        for fut, _ in self._jobs.values():
            fut.cancel()
        self._jobs, self._race = {}, set()

    def close(self) -> None:
        self.abort()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"HybridCompute(mode={self.mode!r}, workers={self.workers}, rates={self.rates}, "
                f"from {self.rates_source})")
