"""Expert residency: host store, device slot cache with eviction, async chunked copy engine, policies.

The model calls exactly one thing here, :func:`create_expert_backend`; see ``docs/runtime.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.kernels.pool import ExpertFormat
from moeflow.moe import ExpertBackend, ResidentExperts
from moeflow.scheduling.backend import OffloadedExperts
from moeflow.scheduling.cache import ExpertCache, Slot, SlotState
from moeflow.scheduling.copy_engine import CopyEngine, LoadTask, chunk_ranges
from moeflow.scheduling.cpu_compute import HybridCompute, fixed_set, resolve_cpu_compute
from moeflow.scheduling.eviction import LFU, LRU, EvictionPolicy, PriorityEviction, Static, make_eviction
from moeflow.scheduling.host_store import HostStore
from moeflow.scheduling.policies import PRESETS, PolicyContext, PolicySpec, get_policy, register_policy
from moeflow.scheduling.predictor import GateSpeculator, Predictor
from moeflow.scheduling.stats import PhaseStats, Stats
from moeflow.scheduling.transport import (
    CudaTransport,
    RandomDelayTransport,
    SyncTransport,
    Transport,
    make_transport,
)

__all__ = [
    "create_expert_backend", "resolve_slots", "min_slots", "OffloadedExperts", "HostStore", "ExpertCache", "Slot",
    "SlotState", "CopyEngine", "LoadTask", "chunk_ranges", "EvictionPolicy", "LRU", "LFU", "Static",
    "PriorityEviction", "make_eviction", "PolicySpec", "PolicyContext", "PRESETS", "get_policy", "register_policy",
    "Predictor", "GateSpeculator", "HybridCompute",
    "Stats", "PhaseStats", "Transport", "SyncTransport", "RandomDelayTransport", "CudaTransport", "make_transport",
]

GiB = 2**30
CUDA_MEMORY_FRACTION = 0.9  # without a budget, experts may take this share of the device minus reserved_bytes


def min_slots(config: OffloadConfig, top_k: int) -> int:
    """Smallest pool accepted: one layer's top-k experts, or the prefill ring, whichever is larger."""
    return max(top_k, config.prefill_ring_slots)


def _size(nbytes: float) -> str:
    """Bytes in the unit that keeps three significant digits readable (tiny test models to Mixtral)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def resolve_slots(
    config: OffloadConfig,
    *,
    fmt: ExpertFormat,
    num_layers: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
    reserved_bytes: int,
) -> int:
    """Number of device expert slots from ``gpu_expert_slots`` or ``gpu_memory_gb`` (capped at all experts).

    Raises SchedulingError below the minimum (saying the minimum) or when "resident" does not fit.
    """
    total = num_layers * num_experts
    spec = get_policy(config.policy)
    if config.gpu_expert_slots is not None:
        n, source = config.gpu_expert_slots, f"gpu_expert_slots={config.gpu_expert_slots}"
    elif config.gpu_memory_gb is not None:
        n = int((config.gpu_memory_gb * GiB - reserved_bytes) // fmt.nbytes)
        source = (
            f"gpu_memory_gb={config.gpu_memory_gb} ({_size(reserved_bytes)} go to non-expert weights and "
            f"KV cache, {_size(fmt.nbytes)} per expert: {max(n, 0)} slots)"
        )
    elif torch.device(device).type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory * CUDA_MEMORY_FRACTION
        n = min(total, int((capacity - reserved_bytes) // fmt.nbytes))
        source = f"{CUDA_MEMORY_FRACTION:.0%} of the device's {capacity / CUDA_MEMORY_FRACTION / GiB:.1f} GiB"
    else:
        n, source = total, "default (every expert)"
    if not spec.offload:
        if n < total:
            raise SchedulingError(
                f"policy 'resident' needs all {total} experts on the device ({total * fmt.nbytes / GiB:.2f} GiB) but "
                f"{source} allows {max(n, 0)}; give more memory or choose an offloading policy such as 'lru'"
            )
        return total
    lowest = min_slots(config, top_k)
    if n < lowest:
        raise SchedulingError(
            f"{source}: too few expert slots; the minimum is {lowest} (the larger of top-k={top_k} and "
            f"prefill_ring_slots={config.prefill_ring_slots}), i.e. {_size(lowest * fmt.nbytes)} of experts"
        )
    return min(n, total)


def create_expert_backend(
    config: OffloadConfig,
    *,
    fmt: ExpertFormat,
    num_layers: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
    kernels_backend: str,
    gates: Sequence[nn.Linear],
    reserved_bytes: int,
    stats: Stats,
    host_store: HostStore | None = None,
    transport: Transport | None = None,
    backend_options: dict | None = None,
    checkpoint_dir=None,
    embed_tokens: nn.Module | None = None,
) -> ExpertBackend:
    """The expert backend of ``config.policy``: :class:`ResidentExperts` or :class:`OffloadedExperts`.

    ``host_store``: an already filled store to share (then the loader need not call ``load_expert``).
    ``transport`` (instead of ``config.transport``) and ``backend_options`` (extra ``OffloadedExperts``
    keywords: ``clock``, ``compute``, ``engine_factory``) are the simulator's seams (``moeflow.sim``).
    ``checkpoint_dir`` / ``embed_tokens``: for the predictor policies (their default predictor files, FineMoE's
    embedding hook; ``moeflow.scheduling.predictive_policies``).
    """
    spec = get_policy(config.policy)
    device = torch.device(device)
    n_slots = resolve_slots(
        config, fmt=fmt, num_layers=num_layers, num_experts=num_experts, top_k=top_k, device=device,
        reserved_bytes=reserved_bytes,
    )
    if not spec.offload:
        return ResidentExperts(fmt, num_layers, num_experts, device, kernels_backend)
    ring = min_slots(config, top_k)
    ctx = PolicyContext(config, num_layers, num_experts, top_k, n_slots, ring, gates, device,
                        checkpoint_dir=checkpoint_dir, embed_tokens=embed_tokens)
    if spec.select is not None:  # "auto": run the preset it picks for this budget
        spec = get_policy(spec.select(ctx))
    if spec.make_predictor is not None:  # first: an eviction policy may rank by the predictor (FineMoE)
        predictor = spec.make_predictor(ctx)
        ctx = dataclasses.replace(ctx, predictor=predictor)
    else:
        predictor = GateSpeculator(gates, top_k, config.prefetch_distance) if spec.speculate else None
    if spec.make_eviction is not None:
        eviction = spec.make_eviction(ctx)
    else:
        eviction = make_eviction(spec.eviction, n_slots=n_slots, ring_slots=ring)
    if spec.backend_options is not None:
        backend_options = {**spec.backend_options(ctx), **(backend_options or {})}
    if transport is None:
        transport = make_transport(config.transport, device, seed=config.seed, random_delay_ms=config.random_delay_ms)
    # hybrid execution (docs/hybrid.md): misses computed on the CPU where the cost model says so
    cpu_mode = resolve_cpu_compute(config, spec, fmt)
    cpu = HybridCompute(cpu_mode, config, fixed_set(eviction)) if cpu_mode != "never" else None
    backend = OffloadedExperts(
        fmt, num_layers=num_layers, num_experts=num_experts, top_k=top_k, n_slots=n_slots, device=device,
        transport=transport, eviction=eviction, stats=stats, retain=spec.retain, predictor=predictor,
        warm_start=spec.warm_start, kernels_backend=kernels_backend, pin_memory=config.pin_memory,
        copy_chunks=config.copy_chunks, max_inflight_chunks=config.max_inflight_chunks, policy_name=spec.name,
        host_store=host_store, per_layer=spec.per_layer, cpu_compute=cpu, **(backend_options or {}),
    )
    bind = getattr(predictor, "bind_backend", None)  # predictors that prefetch outside forward (FineMoE's hook)
    if bind is not None:
        bind(backend)
    return backend

# the predictor presets ("duoserve", "promoe", "finemoe", "auto") and ExpertFlow's PLEC cache ("expertflow",
# moeflow.scheduling.plec) register themselves
from moeflow.scheduling import predictive_policies  # noqa: E402,F401,I001
from moeflow.scheduling import plec  # noqa: E402,F401,I001
