"""The one seam between the offloading runtime and the machine it runs on: :class:`Platform`.

Production uses :data:`REAL`: the wall clock, the transport ``OffloadConfig.transport`` names, the threaded
:class:`~moeflow.offload.copy_engine.CopyEngine`, a host store that holds the real expert bytes, and the
kernels for expert compute. The simulator (``moeflow.sim``) passes its own Platform: a virtual clock, a
transport whose copies take virtual time, a copy engine that replays the worker in that time, a host store
whose tiny regions are never read, and a compute executor that charges the profile's expert time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool
from moeflow.offload.copy_engine import CopyEngine
from moeflow.offload.host_store import HostStore
from moeflow.offload.hybrid import HybridCompute, real_hybrid
from moeflow.offload.transport import Transport, make_transport

# compute(layer, topk_ids int32 [T, k], experts): account the compute of ``experts`` instead of running kernels
ComputeExecutor = Callable[[int, torch.Tensor, list[int]], None]
# hybrid(config, spec, fmt, host, keep_on_device) -> the executor of misses computed on the CPU, or None
HybridFactory = Callable[..., HybridCompute | None]


def config_transport(config, device: torch.device) -> Transport:
    """The transport ``config.transport`` names (``make_transport``)."""
    return make_transport(config.transport, device, seed=config.seed, random_delay_ms=config.random_delay_ms)


def real_host_store(fmt: ExpertFormat, num_layers: int, num_experts: int, *, pin: bool,
                    device: torch.device) -> HostStore:
    return HostStore(fmt, num_layers, num_experts, pin=pin, device=device)


@dataclass(frozen=True)
class Platform:
    """clock() -> seconds; transport(config, device); copy_engine(transport, host, pool, chunks=, max_inflight=);
    host_store(fmt, num_layers, num_experts, pin=, device=); compute: None runs the kernels, else an executor
    that accounts each expert group (the simulator's; an early group names every expert in a ready slot, the
    executor charges the routed ones); read_wait: called where the host waits for a layer's read-back (the
    simulator's clock advances to the routing and through the scheduling there); hybrid: the executor of
    misses computed on the CPU for the policy (``real_hybrid``: the worker pool, or None where the config,
    the experts' format or the kernels do not allow it; the simulator's charges a profile's CPU time)."""

    clock: Callable[[], float] = time.perf_counter
    transport: Callable[..., Transport] = config_transport
    copy_engine: Callable[..., CopyEngine] = CopyEngine
    host_store: Callable[..., HostStore] = real_host_store
    compute: ComputeExecutor | None = None
    read_wait: Callable[[], None] | None = None
    hybrid: HybridFactory = real_hybrid

    def make_engine(self, transport: Transport, host: HostStore, pool: ExpertPool, *, chunks: int,
                    max_inflight: int) -> CopyEngine:
        return self.copy_engine(transport, host, pool, chunks=chunks, max_inflight=max_inflight)


REAL = Platform()
