"""Hardware profiles: what one copy and one unit of compute cost on a given machine, for a given model.

A profile is a dataclass, saved as JSON. Times are for batch-1 inference of one model; the presets are
for Mixtral-8x7B in AWQ 4-bit (87.3 MiB per expert, 32 layers x 8 experts, top-2) and are estimates from
the hardware's data sheet (bandwidths) and roofline arithmetic (compute), not measurements: see
``docs/simulator.md``. ``moeflow bench profile`` measures the machine at hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from moeflow.errors import MoeflowError

GiB = 2**30
MiB = 2**20


class ProfileError(MoeflowError, ValueError):
    """A hardware profile is malformed, physically impossible, or describes another model than the trace."""


def awq_expert_bytes(hidden: int, intermediate: int, group_size: int = 128) -> int:
    """Bytes of one AWQ expert region (every projection with its scales and zeros, 256-byte aligned) as the runtime
    stores it."""
    import torch

    from moeflow.kernels.pool import ExpertFormat

    return ExpertFormat(hidden, intermediate, "awq", torch.float16, group_size).nbytes


MIXTRAL_8X7B = {"num_layers": 32, "num_experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336}


@dataclass(frozen=True)
class HardwareProfile:
    """Costs the simulator charges. Bandwidth in GB/s (1e9 B/s), times in ms unless named otherwise.

    * ``h2d_gbps`` / ``h2d_latency_us``: pinned host->device copy rate and the fixed cost of one copy call
      (one chunk).
    * ``attn_ms`` + ``attn_ms_per_token`` * T: everything of one decoder layer except the experts
      (norms, attention, router) for a forward pass over T tokens.
    * ``expert_ms`` + ``expert_ms_per_token`` * n: one expert applied to the n tokens routed to it
      (reading its weights once, then per-token arithmetic).
    * ``head_ms``: per forward pass outside the layers (embedding, final norm, LM head, sampling).
    * ``sched_ms``: host time per offloaded MoE layer (the routing sync and the Python scheduler).
    * ``gpu_memory_gb`` / ``non_expert_gb``: device memory and what non-expert weights, KV cache and
      activations take (GiB), to say how many slots fit; optional.
    * ``num_layers`` / ``num_experts`` / ``top_k``: the model the compute times are for (None: any); a
      trace of another shape is refused.
    * ``disk_gbps`` / ``disk_latency_us``: the disk the experts that do not fit in host memory are read from
      (cold reads of expert-sized ranges; ``bench profile`` measures them); needed to simulate a host budget.
    """

    name: str
    h2d_gbps: float
    expert_bytes: int
    h2d_latency_us: float = 10.0
    attn_ms: float = 0.0
    attn_ms_per_token: float = 0.0
    expert_ms: float = 0.0
    expert_ms_per_token: float = 0.0
    head_ms: float = 0.0
    sched_ms: float = 0.0
    gpu_memory_gb: float | None = None
    non_expert_gb: float | None = None
    num_layers: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    disk_gbps: float | None = None
    disk_latency_us: float = 100.0
    description: str = ""
    measured: bool = False  # True: written by `moeflow bench profile` (then ``description`` says on what)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ProfileError naming the field: bandwidth must be > 0, times >= 0, sizes > 0."""
        where = f"hardware profile {self.name!r}"
        if not (isinstance(self.h2d_gbps, int | float) and math.isfinite(self.h2d_gbps) and self.h2d_gbps > 0):
            raise ProfileError(f"{where}: h2d_gbps={self.h2d_gbps!r}; the host->device bandwidth must be a "
                               "positive number of GB/s")
        if not (isinstance(self.expert_bytes, int) and self.expert_bytes > 0):
            raise ProfileError(f"{where}: expert_bytes={self.expert_bytes!r} must be a positive integer")
        for name in ("h2d_latency_us", "attn_ms", "attn_ms_per_token", "expert_ms", "expert_ms_per_token",
                     "head_ms", "sched_ms"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ProfileError(f"{where}: {name}={v!r} must be a finite number >= 0")
        if self.disk_gbps is not None and not (isinstance(self.disk_gbps, int | float) and self.disk_gbps > 0):
            raise ProfileError(f"{where}: disk_gbps={self.disk_gbps!r} must be a positive number of GB/s or null")
        if not (isinstance(self.disk_latency_us, int | float) and self.disk_latency_us >= 0):
            raise ProfileError(f"{where}: disk_latency_us={self.disk_latency_us!r} must be a number >= 0")
        for name in ("gpu_memory_gb", "non_expert_gb"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and v >= 0):
                raise ProfileError(f"{where}: {name}={v!r} must be >= 0 or null")
        for name in ("num_layers", "num_experts", "top_k"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ProfileError(f"{where}: {name}={v!r} must be a positive integer or null")

    # ----------------------------------------------------------------- derived costs (seconds)
    @property
    def bandwidth_bps(self) -> float:
        return self.h2d_gbps * 1e9

    def copy_s(self, chunks: int = 1) -> float:
        """One whole expert in ``chunks`` copy calls."""
        return self.expert_bytes / self.bandwidth_bps + chunks * self.h2d_latency_us * 1e-6

    def attn_s(self, tokens: int) -> float:
        return (self.attn_ms + self.attn_ms_per_token * tokens) * 1e-3

    def expert_s(self, tokens: int) -> float:
        return (self.expert_ms + self.expert_ms_per_token * tokens) * 1e-3

    @property
    def head_s(self) -> float:
        return self.head_ms * 1e-3

    @property
    def sched_s(self) -> float:
        return self.sched_ms * 1e-3

    def max_slots(self) -> int | None:
        """Expert slots that fit next to everything else (None without memory figures)."""
        if self.gpu_memory_gb is None or self.non_expert_gb is None:
            return None
        return max(0, int((self.gpu_memory_gb - self.non_expert_gb) * GiB // self.expert_bytes))

    # ----------------------------------------------------------------- checks against a trace
    def check_trace(self, num_layers: int, num_experts: int, top_k: int, source: str = "the trace") -> None:
        """ProfileError naming every count that disagrees with the trace's."""
        bad = [f"{name}: {source} has {theirs}, the profile {mine}"
               for name, mine, theirs in (("num_layers", self.num_layers, num_layers),
                                          ("num_experts", self.num_experts, num_experts),
                                          ("top_k", self.top_k, top_k))
               if mine is not None and mine != theirs]
        if bad:
            raise ProfileError(f"hardware profile {self.name!r} describes another model than {source} ("
                               + "; ".join(bad) + "); use a profile for this model, or give its expert size "
                               "and compute times (--expert-mb, --layer-ms, --expert-ms)")

    # ----------------------------------------------------------------- files
    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> HardwareProfile:
        if not isinstance(d, dict):
            raise ProfileError(f"{source}: a hardware profile is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"{source}: unknown profile fields {unknown} (known: {sorted(known)})")
        missing = [k for k in ("name", "h2d_gbps", "expert_bytes") if k not in d]
        if missing:
            raise ProfileError(f"{source}: profile lacks {missing}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read hardware profile {path}: {e}") from e
        return cls.from_dict(d, str(path))

    def with_overrides(self, **overrides: Any) -> HardwareProfile:
        """A copy with the non-None ``overrides`` applied (validated)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **changes) if changes else self


def _mixtral_preset(name: str, description: str, **costs: Any) -> HardwareProfile:
    m = MIXTRAL_8X7B
    return HardwareProfile(name=name, expert_bytes=awq_expert_bytes(m["hidden"], m["intermediate"]),
                           num_layers=m["num_layers"], num_experts=m["num_experts"], top_k=m["top_k"],
                           description=description, **costs)


def _presets() -> dict[str, HardwareProfile]:
    return {
        # PCIe 4.0 x16 (~25 GB/s pinned in practice), a 24 GB consumer GPU (~1 TB/s HBM, RTX 3090/4090 class)
        "pcie4-24gb": _mixtral_preset(
            "pcie4-24gb",
            "Mixtral-8x7B AWQ on a 24 GB GPU over PCIe 4.0 x16: 25 GB/s pinned copies; compute from ~0.8 TB/s "
            "effective memory bandwidth (decode) and ~80 TFLOP/s (prefill). Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.12, attn_ms_per_token=0.002, expert_ms=0.13,
            expert_ms_per_token=0.0045, head_ms=0.35, sched_ms=0.15, gpu_memory_gb=24.0, non_expert_gb=4.3,
        ),
        # H100 PCIe: PCIe 5.0 x16 (~50 GB/s pinned), 80 GB HBM2e at 2 TB/s
        "h100-pcie5": _mixtral_preset(
            "h100-pcie5",
            "Mixtral-8x7B AWQ on an H100 PCIe (80 GB) over PCIe 5.0 x16: 50 GB/s pinned copies; compute from "
            "~1.6 TB/s effective HBM bandwidth (decode) and ~250 TFLOP/s (prefill). Estimates, not measurements.",
            h2d_gbps=50.0, h2d_latency_us=8.0, attn_ms=0.065, attn_ms_per_token=0.0008, expert_ms=0.065,
            expert_ms_per_token=0.0015, head_ms=0.18, sched_ms=0.1, gpu_memory_gb=80.0, non_expert_gb=6.0,
        ),
    }


PRESET_NAMES = ("pcie4-24gb", "h100-pcie5")


def get_profile(name_or_path: str) -> HardwareProfile:
    """A preset by name, or a profile JSON file."""
    presets = _presets()
    if name_or_path in presets:
        return presets[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ProfileError(f"hardware profile file {path} does not exist")
        return HardwareProfile.load(path)
    raise ProfileError(f"unknown hardware profile {name_or_path!r}: a preset ({', '.join(presets)}) or a JSON file "
                       "written by `moeflow bench profile`")


def presets() -> dict[str, HardwareProfile]:
    return _presets()


def custom_profile(*, h2d_gbps: float, expert_mb: float, layer_ms: float | None = None, latency_us: float = 10.0,
                   name: str = "custom", **fields_: Any) -> HardwareProfile:
    """A profile for any model from the command line's figures (expert size in MiB; ``layer_ms`` is ``attn_ms``;
    other keywords are :class:`HardwareProfile` fields)."""
    if layer_ms is not None:
        fields_.setdefault("attn_ms", layer_ms)
    return HardwareProfile(name=name, h2d_gbps=h2d_gbps, expert_bytes=max(1, int(round(expert_mb * MiB))),
                           h2d_latency_us=latency_us, **fields_)
