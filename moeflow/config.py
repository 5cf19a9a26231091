"""User-facing configuration of expert offloading."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

CPU_COMPUTE = ("auto", "never", "always")


@dataclass
class OffloadConfig:
    """How experts are placed and streamed.

    gpu_expert_slots: number of expert slots in the device pool (each holds one expert of any layer).
        ``None`` with ``gpu_memory_gb`` unset means every expert resident when the policy is "resident".
    gpu_memory_gb: alternatively, a device memory budget in GB; the slot count is what is left after the
        non-expert weights, the KV cache, activations and workspaces (``model.memory_plan()``, docs/disk.md).
        "auto": the device's free memory minus a margin.
    policy: a named policy (``POLICIES``; the table is ``moeflow.offload.policies.POLICY_TABLE``).
    prefetch_distance: how many layers ahead predictive policies prefetch.
    transport: "auto" (CUDA streams on a GPU, synchronous on the CPU), "sync", or "random-delay"
        (a test transport that completes copies late and out of order).
    pin_memory: pin the host store (falls back to pageable memory with a warning when pinning fails).
    seed: seed of the random-delay test transport.
    copy_chunks: chunks per expert copy (ProMoE: one per matrix); a needed expert waits at most one chunk.
    prefill_ring_slots: slots a layer streams its missing experts through when they do not all fit; with
        the largest top-k this is the smallest slot count accepted.
    max_inflight_chunks: chunks handed to the transport before the copy engine waits; small keeps the
        queue preemptible, 2 keeps the copy engine busy across the worker's wake-up.
    random_delay_ms: upper bound of the random completion delay of the "random-delay" transport.
    cpu_compute: where a missed expert runs (AWQ experts, torch's int4 CPU kernels; see docs/hybrid.md):
        "never" (copy it to the device), "always" (compute it on the CPU; experts a static placement keeps on
        the device are still copied), "auto" (a cost model picks copy, CPU or both per expert). ``None``: the
        policy's default ("always" for "fiddler", "never" otherwise).
    cpu_workers: threads computing experts on the CPU (each uses torch's intra-op threads).
    cpu_expert_ms, cpu_token_ms, h2d_gbps: cost-model rates (CPU ms for one expert and one token, ms per
        further token, host->device GB/s); each one given replaces its start-up calibration.
    calibration_file: where the measured rates are cached (default: ``$MOEFLOW_CACHE_DIR`` or
        ``~/.cache/moeflow``, one file per machine, model shape and torch version).
    race_margin: "auto" starts both the copy and the CPU compute when their estimates are within this
        fraction of each other, and uses whichever finishes first.
    predictor_path: the trained predictor file of the "duoserve" / "promoe" policies (``moeflow train-predictor``);
        ``None``: ``<checkpoint dir>/predictors/<kind>.pt``. "finemoe" may name a warmed store (else it starts
        empty and fills as it serves). See docs/policies.md.
    host_memory_gb: keep at most this many GB in host memory (experts, plus the non-expert weights and KV cache
        when they live there, plus the disk staging buffers); experts that do not fit are read from the
        checkpoint's files when needed or predicted (docs/disk.md). "auto": the machine's available memory
        minus a margin. ``None``: every expert in host memory.
    disk_readers: threads reading experts from disk (the disk tier's reads overlap compute and each other).
    background_load: return from ``from_pretrained`` once the non-expert weights are loaded (and the first
        slots' experts read): the experts fill host memory in the background (``max(disk_readers, cores)``
        threads), and an expert needed before its turn is read at once through the disk tier's path
        (docs/disk.md); the same tokens. A shard truncated or deleted meanwhile fails only the requests that
        need its experts, with an error naming the file. Offloading policies only.
    context_length, max_batch_size: what the memory plan sizes the KV cache, activations and workspaces for
        (``None``: 4096 tokens, capped at the model's context).
    early_hits: launch each layer's expert group over the experts already in slots before its routing is read
        back, so the device computes the hits while the host waits and schedules the misses (docs/design.md,
        "Hits launched before the read-back"); the same tokens either way. ``None``: on where that read is a
        real wait (a CUDA device) and the experts run on the Triton kernels.
    policy_options: switches between a paper's mechanism as written and moeflow's variant, by name, over the
        policy's own (``moeflow.offload.policies.spec.Mechanisms``; docs/papers.md), e.g.
        ``{"refresh_on_prefetch": True, "prefetch_chunks": "per-linear"}``. ``None``: the policy's.
    """

    gpu_expert_slots: int | None = None
    gpu_memory_gb: float | str | None = None
    policy: str = "resident"
    prefetch_distance: int = 1
    transport: str = "auto"
    pin_memory: bool = True
    seed: int = 0
    copy_chunks: int = 3
    prefill_ring_slots: int = 2
    max_inflight_chunks: int = 2
    random_delay_ms: float = 2.0
    cpu_compute: str | None = None
    cpu_workers: int = 1
    cpu_expert_ms: float | None = None
    cpu_token_ms: float | None = None
    h2d_gbps: float | None = None
    calibration_file: str | None = None
    race_margin: float = 0.25
    predictor_path: str | None = None
    host_memory_gb: float | str | None = None
    disk_readers: int = 2
    background_load: bool = False
    context_length: int | None = None
    max_batch_size: int = 1
    early_hits: bool | None = None
    policy_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.gpu_expert_slots is not None and self.gpu_expert_slots < 1:
            raise ValueError(f"OffloadConfig.gpu_expert_slots must be >= 1, got {self.gpu_expert_slots}")
        for name in ("gpu_memory_gb", "host_memory_gb"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value != "auto":
                    raise ValueError(f"OffloadConfig.{name}={value!r}: expected a number of GB or 'auto'")
            elif value is not None and not value > 0:
                raise ValueError(f"OffloadConfig.{name} must be > 0, got {value}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"OffloadConfig.context_length must be >= 1, got {self.context_length}")
        if self.max_batch_size < 1:
            raise ValueError(f"OffloadConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.prefetch_distance < 1:
            raise ValueError(f"OffloadConfig.prefetch_distance must be >= 1, got {self.prefetch_distance}")
        if self.transport not in ("auto", "sync", "random-delay"):
            raise ValueError(
                f"OffloadConfig.transport={self.transport!r}: expected 'auto', 'sync' or 'random-delay'"
            )

        for name in ("copy_chunks", "prefill_ring_slots", "max_inflight_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"OffloadConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.random_delay_ms < 0:
            raise ValueError(f"OffloadConfig.random_delay_ms must be >= 0, got {self.random_delay_ms}")
        if self.cpu_compute is not None and self.cpu_compute not in CPU_COMPUTE:
            raise ValueError(
                f"OffloadConfig.cpu_compute={self.cpu_compute!r}: expected 'auto', 'never' or 'always' (or None "
                "for the policy's default)"
            )
        if self.cpu_workers < 1:
            raise ValueError(f"OffloadConfig.cpu_workers must be >= 1, got {self.cpu_workers}")
        for name in ("cpu_expert_ms", "h2d_gbps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"OffloadConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.cpu_token_ms is not None and self.cpu_token_ms < 0:
            raise ValueError(f"OffloadConfig.cpu_token_ms must be >= 0, got {self.cpu_token_ms}")
        if self.background_load and self.policy == "resident":
            raise ValueError("OffloadConfig.background_load=True needs an offloading policy (the experts are read "
                             "into host memory in the background and copied to the slots from there); got "
                             "policy='resident'")
        if self.disk_readers < 1:
            raise ValueError(f"OffloadConfig.disk_readers must be >= 1, got {self.disk_readers}")
        if self.race_margin < 0:
            raise ValueError(f"OffloadConfig.race_margin must be >= 0, got {self.race_margin}")
        if self.policy_options is not None and not isinstance(self.policy_options, dict):
            raise ValueError(f"OffloadConfig.policy_options must be a dict of option -> value, got "
                             f"{type(self.policy_options).__name__}")

    def as_dict(self) -> dict:
        return asdict(self)


def load_workers(requested: int | None = None) -> int:
    """Threads for loading: ``requested``, else ``$MOEFLOW_LOAD_WORKERS``, else the usable cores (at most 16)."""
    if requested is None:
        env = os.environ.get("MOEFLOW_LOAD_WORKERS")
        requested = int(env) if env else min(len(os.sched_getaffinity(0)), 16)
    if requested < 1:
        raise ValueError(f"load workers must be >= 1, got {requested}")
    return requested
