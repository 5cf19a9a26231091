"""Expert residency: host store, device slot cache with eviction, async chunked copy engine, policies.

The model calls exactly one thing here, :func:`create_expert_backend`; see ``docs/runtime.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.kernels.formats import ExpertFormat
from moeflow.moe import ExpertBackend, ResidentExperts
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.cache import ExpertCache, Slot, SlotState
from moeflow.offload.copy_engine import CopyEngine, LoadTask, chunk_ranges
from moeflow.offload.disk_store import DiskHostStore, DiskStats
from moeflow.offload.disk_tier import maybe_disk_store, staged_engine_factory
from moeflow.offload.eviction import LFU, LRU, EvictionPolicy, PriorityEviction, Static, make_eviction
from moeflow.offload.host_store import HostStore
from moeflow.offload.hybrid import HybridCompute, fixed_set
from moeflow.offload.platform import REAL, Platform
from moeflow.offload.policies import (
    POLICY_NAMES,
    POLICY_TABLE,
    PolicyContext,
    PolicySpec,
    get_policy,
    register_policy,
    registered_policies,
    unregister_policy,
)
from moeflow.offload.policies.expertflow.scheduler import group_by_routing
from moeflow.offload.policies.mixtral_offloading.runtime import GateSpeculator
from moeflow.offload.predictors.interface import Predictor
from moeflow.offload.stats import PhaseStats, Stats
from moeflow.offload.transport import (
    CudaTransport,
    RandomDelayTransport,
    SyncTransport,
    Transport,
    make_transport,
)
from moeflow.offload.units import format_bytes as _size

__all__ = [
    "create_expert_backend", "resolve_slots", "min_slots", "OffloadedExperts", "HostStore", "DiskHostStore",
    "DiskStats",
    "ExpertCache", "Slot",
    "SlotState", "CopyEngine", "LoadTask", "chunk_ranges", "EvictionPolicy", "LRU", "LFU", "Static",
    "PriorityEviction", "make_eviction", "PolicySpec", "PolicyContext", "POLICY_TABLE", "POLICY_NAMES",
    "get_policy", "register_policy", "unregister_policy", "registered_policies", "Predictor", "GateSpeculator",
    "HybridCompute", "Platform", "REAL", "group_by_routing",
    "Stats", "PhaseStats", "Transport", "SyncTransport", "RandomDelayTransport", "CudaTransport", "make_transport",
]

GiB = 2**30
CUDA_MEMORY_FRACTION = 0.9  # without a budget, experts may take this share of the device minus reserved_bytes


def min_slots(config: OffloadConfig, top_k: int) -> int:
    """Smallest pool accepted: one layer's top-k experts, or the prefill ring, whichever is larger."""
    return max(top_k, config.prefill_ring_slots)


def resolve_slots(
    config: OffloadConfig,
    *,
    fmt: ExpertFormat,
    num_layers: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
    reserved_bytes: int,
    spec: PolicySpec | None = None,
) -> int:
    """Number of device expert slots from ``gpu_expert_slots`` or ``gpu_memory_gb`` (capped at all experts).

    Raises SchedulingError below the minimum (saying the minimum) or when "resident" does not fit.
    """
    total = num_layers * num_experts
    spec = spec or get_policy(config.policy)
    if config.gpu_expert_slots is not None:
        n, source = config.gpu_expert_slots, f"gpu_expert_slots={config.gpu_expert_slots}"
    elif config.gpu_memory_gb is not None:
        n = int((config.gpu_memory_gb * GiB - reserved_bytes) // fmt.nbytes)
        source = (
            f"gpu_memory_gb={config.gpu_memory_gb} ({_size(reserved_bytes)} go to non-expert weights, "
            f"KV cache, activations and workspaces, {_size(fmt.nbytes)} per expert: {max(n, 0)} slots)"
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
    gates: Sequence[nn.Module],
    reserved_bytes: int,
    stats: Stats,
    checkpoint_dir=None,
    route: Callable | None = None,
    host_store: HostStore | None = None,
    platform: Platform = REAL,
    policies: Mapping[str, PolicySpec] | None = None,
    expert_source=None,
    host_reserved_bytes: int = 0,
) -> ExpertBackend:
    """The expert backend of ``config.policy``: :class:`ResidentExperts` or :class:`OffloadedExperts`.

    gates: one router per MoE layer (x [T, H] -> logits [T, E]); route: logits [T, E] -> (probs fp32 [T, E],
    ids int32 [T, k], weights fp32 [T, k]), the family's routing for speculation (None: softmax-top-k).
    checkpoint_dir: where the predictor policies look for ``predictors/<kind>.pt``.
    host_store: an already filled store to share (then the loader need not call ``load_expert``).
    platform: clock, transport, copy engine, host store and compute executor (the simulator's seam).
    policies: the table ``config.policy`` is looked up in (default: the built-in table plus user policies;
    the simulator adds its own "oracle").
    expert_source: the checkpoint's :class:`~moeflow.io.expert_index.ExpertIndex`; with ``host_memory_gb`` the
    experts that do not fit in host memory are read through it (the disk tier, :mod:`moeflow.offload.disk_tier`).
    host_reserved_bytes: host memory ``host_memory_gb`` must also hold (non-expert weights on a CPU device).
    """
    spec = get_policy(config.policy, policies)
    device = torch.device(device)
    n_slots = resolve_slots(
        config, fmt=fmt, num_layers=num_layers, num_experts=num_experts, top_k=top_k, device=device,
        reserved_bytes=reserved_bytes, spec=spec,
    )
    if not spec.offload:
        return ResidentExperts(fmt, num_layers, num_experts, device, kernels_backend)
    ring = min_slots(config, top_k)
    ctx = PolicyContext(config, num_layers, num_experts, top_k, n_slots, ring, list(gates), device,
                        checkpoint_dir=checkpoint_dir, route=route)
    if spec.select is not None:  # "auto": run the policy it picks for this budget
        spec = get_policy(spec.select(ctx), policies)
    mechanisms = spec.mechanisms.with_options(config.policy_options)
    ctx = dataclasses.replace(ctx, mechanisms=mechanisms)
    predictor = spec.predictor(ctx) if spec.predictor is not None else None
    ctx = dataclasses.replace(ctx, predictor=predictor)  # an eviction policy may rank by the predictor (FineMoE)
    eviction = spec.eviction(ctx)
    owns_host = host_store is None
    disk = None if host_store is not None else maybe_disk_store(
        config, expert_source=expert_source, fmt=fmt, total=num_layers * num_experts, min_rows=ring,
        device_eviction=eviction, host_reserved_bytes=host_reserved_bytes, device=device)
    if disk is not None:  # copies first wait for their expert to be read from disk into host memory
        platform = dataclasses.replace(platform, copy_engine=staged_engine_factory(platform.copy_engine, disk))
    host = host_store or disk or platform.host_store(fmt, num_layers, num_experts, pin=config.pin_memory,
                                                     device=device)
    if (host.num_layers, host.num_experts) != (num_layers, num_experts):
        raise ValueError("the given host store holds another model's experts")
    # hybrid execution (docs/hybrid.md): misses computed on the CPU where the cost model says so
    cpu = platform.hybrid(config, spec, fmt, host, fixed_set(eviction))
    return OffloadedExperts(
        fmt, top_k=top_k, n_slots=n_slots, device=device, host=host, transport=platform.transport(config, device),
        eviction=eviction, stats=stats, predictor=predictor, cpu=cpu, retain=spec.retain,
        warm_start=spec.warm_start, per_layer=spec.per_layer, prefill_ring=top_k if spec.prefill_ring else None,
        copy_chunks=config.copy_chunks, max_inflight_chunks=config.max_inflight_chunks,
        kernels_backend=kernels_backend, policy_name=spec.name, owns_host=owns_host, platform=platform,
        early_hits=config.early_hits, mechanisms=mechanisms,
        h2d_bytes_per_s=config.h2d_gbps * 1e9 if config.h2d_gbps is not None else None,
    )
