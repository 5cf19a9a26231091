"""Hardware profiles: what one copy and one unit of compute cost on a given machine, for a given model.

A profile is a dataclass, saved as JSON. Times are for batch-1 inference of one model; the presets are
for Mixtral-8x7B in AWQ 4-bit (87.3 MiB per expert, 32 layers x 8 experts, top-2; ``pcie4-24gb``,
``h100-pcie5``), Qwen3-30B-A3B and Qwen3-235B-A22B (128 experts, top-8; ``qwen3-*``) and are estimates from
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

    from moeflow.kernels.formats import expert_format

    return expert_format(hidden, intermediate, "awq", torch.float16, group_size).nbytes


def mxfp4_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of one gpt-oss MXFP4 expert region (e2m1 blocks, e8m0 scales, bf16 biases, 256-byte aligned)."""
    import torch

    from moeflow.kernels.formats import biased_expert_format

    return biased_expert_format(hidden, intermediate, "mxfp4", torch.bfloat16, 32, activation="clamped_swiglu").nbytes


MIXTRAL_8X7B = {"num_layers": 32, "num_experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336}
# many small experts: ~2.5 MB (30B-A3B) and ~9.7 MB (235B-A22B) per AWQ expert, 6,144 and 12,032 experts
QWEN3_30B_A3B = {"num_layers": 48, "num_experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}
QWEN3_235B_A22B = {"num_layers": 94, "num_experts": 128, "top_k": 8, "hidden": 4096, "intermediate": 1536}
# DeepSeek-V3 / R1 / V3.1 / V3.2: 61 decoder layers, the first 3 dense, so 58 MoE layers (what a trace counts).
# Kimi-K2 is another shape (first_k_dense_replace 1: 60 MoE layers x 384 experts, top-8, 7168 x 2048).
DEEPSEEK_V3 = {"num_layers": 58, "num_experts": 256, "top_k": 8, "hidden": 7168, "intermediate": 2048}
# GLM-4.5-Air: 46 decoder layers, the first dense, so 45 MoE layers
GLM45_AIR = {"num_layers": 45, "num_experts": 128, "top_k": 8, "hidden": 4096, "intermediate": 1408}
# MiniMax-M2: 62 layers, every one MoE; Qwen3-Next-80B-A3B: 48 layers (36 linear-attention, 12 full), every one MoE
MINIMAX_M2 = {"num_layers": 62, "num_experts": 256, "top_k": 8, "hidden": 3072, "intermediate": 1536}
QWEN3_NEXT_80B = {"num_layers": 48, "num_experts": 512, "top_k": 10, "hidden": 2048, "intermediate": 512}
GPT_OSS_20B = {"num_layers": 24, "num_experts": 32, "top_k": 4, "hidden": 2880, "intermediate": 2880}
GPT_OSS_120B = {"num_layers": 36, "num_experts": 128, "top_k": 4, "hidden": 2880, "intermediate": 2880}


@dataclass(frozen=True)
class HardwareProfile:
    """Costs the simulator charges. Bandwidth in GB/s (1e9 B/s), times in ms unless named otherwise.

    * ``h2d_gbps`` / ``h2d_latency_us``: pinned host->device copy rate and the fixed cost of one copy call
      (one chunk). ``h2d_gbps=math.inf`` with no latency is an ideal link: a copy lands at the instant it is
      issued, as the runtime's synchronous copies do (what validates the simulator's counts against them).
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
    * ``cpu_gbps`` / ``cpu_call_us`` / ``cpu_token_ms`` / ``cpu_free_tokens``: one expert computed on the CPU
      (hybrid execution, ``fiddler``, llama.cpp's ``--n-cpu-moe``): the expert's bytes streamed at ``cpu_gbps``,
      plus ``cpu_call_us`` per call (dispatch, the activations to the host and the rows back), plus
      ``cpu_token_ms`` for each token past the first ``cpu_free_tokens`` (whose arithmetic hides under the
      weight read); ``cpu_gbps`` None: no CPU cost known, and policies that compute on the CPU are refused.
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
    cpu_gbps: float | None = None
    cpu_call_us: float = 0.0
    cpu_token_ms: float = 0.0
    cpu_free_tokens: float = 1.0
    description: str = ""
    measured: bool = False  # True: written by `moeflow bench profile` (then ``description`` says on what)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ProfileError naming the field: bandwidth must be > 0, times >= 0, sizes > 0."""
        where = f"hardware profile {self.name!r}"
        if not (isinstance(self.h2d_gbps, int | float) and not math.isnan(self.h2d_gbps) and self.h2d_gbps > 0):
            raise ProfileError(f"{where}: h2d_gbps={self.h2d_gbps!r}; the host->device bandwidth must be a "
                               "positive number of GB/s (inf: an ideal link, copies take no time)")
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
        if self.cpu_gbps is not None and not (isinstance(self.cpu_gbps, int | float) and math.isfinite(self.cpu_gbps)
                                              and self.cpu_gbps > 0):
            raise ProfileError(f"{where}: cpu_gbps={self.cpu_gbps!r} must be a positive number of GB/s or null")
        for name in ("cpu_call_us", "cpu_token_ms"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ProfileError(f"{where}: {name}={v!r} must be a finite number >= 0")
        if not (isinstance(self.cpu_free_tokens, int | float) and self.cpu_free_tokens >= 1):
            raise ProfileError(f"{where}: cpu_free_tokens={self.cpu_free_tokens!r} must be >= 1")
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

    def require_cpu(self, why: str) -> None:
        """ProfileError when the profile has no CPU cost (``cpu_gbps``), saying what needs it."""
        if self.cpu_gbps is None:
            raise ProfileError(f"hardware profile {self.name!r} has no CPU compute cost (cpu_gbps), which {why} needs: "
                               "give --cpu-gbps (and --cpu-call-us, --cpu-token-ms), or a profile measured by "
                               "`moeflow bench profile`")

    def cpu_weights_s(self) -> float:
        """Streaming one expert's bytes through the CPU kernel (the memory-bound part of a call)."""
        self.require_cpu("CPU expert compute")
        return self.expert_bytes / (self.cpu_gbps * 1e9)

    def cpu_extra_tokens_s(self, tokens: int) -> float:
        """The arithmetic of ``tokens`` tokens past the ones hidden under the weight read."""
        return max(0.0, tokens - self.cpu_free_tokens) * self.cpu_token_ms * 1e-3

    def cpu_expert_s(self, tokens: int) -> float:
        """One expert computed on the CPU for ``tokens`` tokens: call + weight read + the extra tokens."""
        return self.cpu_call_us * 1e-6 + self.cpu_weights_s() + self.cpu_extra_tokens_s(tokens)

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


# The host CPU of the Mixtral presets (estimates, scaled from measurements on one core, not measured on such hosts):
# moeflow's int4 CPU kernel streams a Mixtral expert at 14.3 GB/s on one Zen 3 core and needs ~2.3 ms per further
# token per core past ~3 tokens (benchmarks/results/cpu_native/README.md). A desktop (8 cores, dual-channel DDR5,
# ~60 GB/s bus): 50 GB/s, 2.3 / 8 ms per token. A server beside an H100 (32 cores for the workers, 8+ channels of
# DDR5): 100 GB/s, 2.3 / 32 ms per token. Free tokens: where the per-token arithmetic meets the weight read. The
# 30 us per call (pool dispatch, activations to the host, rows back over PCIe) is an estimate.
DESKTOP_CPU = {"cpu_gbps": 50.0, "cpu_call_us": 30.0, "cpu_token_ms": 0.29, "cpu_free_tokens": 6.3}
SERVER_CPU = {"cpu_gbps": 100.0, "cpu_call_us": 30.0, "cpu_token_ms": 0.072, "cpu_free_tokens": 12.7}
CPU_NOTE = " CPU: {cpu_gbps:g} GB/s per expert call, {cpu_call_us:g} us per call (scaled from cpu_native, estimates)."


def _mixtral_preset(name: str, description: str, **costs: Any) -> HardwareProfile:
    return _shaped_preset(MIXTRAL_8X7B, name, description, **costs)


def _shaped_preset(model: dict[str, int], name: str, description: str, expert_bytes=None,
                   **costs: Any) -> HardwareProfile:
    """A preset for the model of shape ``model`` (layers, experts, top-k); ``expert_bytes(hidden, intermediate)``
    sizes one expert (default: AWQ g128)."""
    size = expert_bytes or awq_expert_bytes
    return HardwareProfile(name=name, expert_bytes=size(model["hidden"], model["intermediate"]),
                           num_layers=model["num_layers"], num_experts=model["num_experts"], top_k=model["top_k"],
                           description=description, **costs)


def _family_presets() -> dict[str, HardwareProfile]:
    """DeepSeek-V3-, GLM-4.5-Air-, MiniMax-M2- and Qwen3-Next-shaped models, AWQ 4-bit experts, on 16-24 GB
    PCIe 4.0 GPUs (estimates, derivation in docs/simulator.md): decode times from the bytes read at ~0.6-0.8 TB/s
    effective plus ~0.01 ms per launch, prefill per-token times from the FLOPs at ~80 TFLOP/s. The dense first
    layers and the LM head are in ``head_ms``."""
    return {
        # expert 3 x 7168 x 2048 int4 (~21.4 MiB); per MoE layer MLA (~187 M params) + the shared expert (~44 M)
        # in int4 ~116 MB; head: the 129,280 x 7168 fp16 LM head (1.85 GB) + 3 dense layers in int4 (~0.9 GB)
        "deepseek-v3-pcie4-24gb": _shaped_preset(
            DEEPSEEK_V3, "deepseek-v3-pcie4-24gb",
            "DeepSeek-V3-shaped (58 MoE layers x 256 experts, top-8, intermediate 2048) AWQ on a 24 GB GPU over "
            "PCIe 4.0 x16: 25 GB/s pinned copies; ~10 GB non-expert (int4 attention and shared experts, fp16 "
            "embeddings/LM head, latent KV cache). Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.16, attn_ms_per_token=0.006, expert_ms=0.037,
            expert_ms_per_token=0.0011, head_ms=3.4, sched_ms=0.15, gpu_memory_gb=24.0, non_expert_gb=10.0,
        ),
        # expert 3 x 4096 x 1408 int4 (~8.4 MiB); per MoE layer GQA attention (~109 M) + shared expert (~17 M) in
        # int4 ~63 MB; head: the 151,552 x 4096 fp16 LM head (1.24 GB) + 1 dense layer
        "glm45-air-pcie4-24gb": _shaped_preset(
            GLM45_AIR, "glm45-air-pcie4-24gb",
            "GLM-4.5-Air-shaped (45 MoE layers x 128 experts, top-8, intermediate 1408) AWQ on a 24 GB GPU over "
            "PCIe 4.0 x16: 25 GB/s pinned copies; ~6.5 GB non-expert. Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.09, attn_ms_per_token=0.0032, expert_ms=0.021,
            expert_ms_per_token=0.00043, head_ms=1.7, sched_ms=0.15, gpu_memory_gb=24.0, non_expert_gb=6.5,
        ),
        # expert 3 x 3072 x 1536 int4 (~7.3 MiB); per layer GQA attention (48 x 128 q, 8 x 128 k/v: ~44 M params)
        # in int4 ~23 MB read at ~0.8 TB/s plus launches; head: the 200,064 x 3072 fp16 LM head (1.23 GB).
        # Non-expert: attention 1.4 GB + embeddings and head 2.46 GB + a 4k-token KV cache 1.04 GB + workspace.
        "minimax-m2-pcie4-24gb": _shaped_preset(
            MINIMAX_M2, "minimax-m2-pcie4-24gb",
            "MiniMax-M2-shaped (62 MoE layers x 256 experts, top-8, 3072 x 1536) AWQ on a 24 GB GPU over PCIe 4.0 "
            "x16: 25 GB/s pinned copies; ~5.5 GB non-expert. Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.05, attn_ms_per_token=0.0012, expert_ms=0.012,
            expert_ms_per_token=0.00035, head_ms=1.6, sched_ms=0.15, gpu_memory_gb=24.0, non_expert_gb=5.5,
        ),
        # expert 3 x 2048 x 512 int4 (~1.6 MiB); per layer ~35 M params of 16-bit projections (the DeltaNet's or
        # the gated attention's, and the shared expert: moeflow keeps them 16-bit) read at ~0.6 TB/s plus the
        # DeltaNet's small kernels; head: the 151,936 x 2048 fp16 LM head (0.62 GB). Non-expert: 3.4 GB of
        # layers + 1.24 GB embeddings and head + KV of the 12 full-attention layers and the linear states.
        "qwen3-next-pcie4-16gb": _shaped_preset(
            QWEN3_NEXT_80B, "qwen3-next-pcie4-16gb",
            "Qwen3-Next-80B-A3B-shaped (48 MoE layers x 512 experts, top-10, 2048 x 512) AWQ experts on a 16 GB GPU "
            "over PCIe 4.0 x16: 25 GB/s pinned copies; ~5.2 GB non-expert. Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.17, attn_ms_per_token=0.0015, expert_ms=0.004,
            expert_ms_per_token=0.00008, head_ms=1.0, sched_ms=0.15, gpu_memory_gb=16.0, non_expert_gb=5.2,
        ),
    }


def _gpt_oss_preset(name: str, model: dict[str, int], description: str, **costs: Any) -> HardwareProfile:
    return _shaped_preset(model, name, description, expert_bytes=mxfp4_expert_bytes, **costs)


def _gpt_oss_presets() -> dict[str, HardwareProfile]:
    """gpt-oss with MXFP4 experts (13.2 MB each; 24 x 32 = 10.2 GB for 20b, 36 x 128 = 61 GB for 120b). Per layer
    the attention reads ~53 MB of bf16 weights (q 2880x4096, k/v 2880x512, o 4096x2880); the LM head and
    embeddings are 2 x 1.16 GB; non-expert memory = those weights + KV cache and activations for 4k tokens."""
    pcie4 = dict(h2d_gbps=25.0, h2d_latency_us=10.0, sched_ms=0.15)
    return {
        # a 12 GB consumer GPU (~0.8 TB/s effective) over PCIe 4.0: gpt-oss-20b's experts do not all fit
        "gpt-oss-20b-12gb": _gpt_oss_preset(
            "gpt-oss-20b-12gb", GPT_OSS_20B,
            "gpt-oss-20b MXFP4 on a 12 GB GPU over PCIe 4.0 x16: 25 GB/s pinned copies; compute from ~0.8 TB/s "
            "effective memory bandwidth (decode) and ~80 TFLOP/s (prefill). Estimates, not measurements.",
            attn_ms=0.075, attn_ms_per_token=0.0007, expert_ms=0.025, expert_ms_per_token=0.0006, head_ms=1.5,
            gpu_memory_gb=12.0, non_expert_gb=4.2, **pcie4,
        ),
        # gpt-oss-120b on a 24 GB GPU over PCIe 4.0 (RTX 3090/4090 class)
        "gpt-oss-120b-24gb": _gpt_oss_preset(
            "gpt-oss-120b-24gb", GPT_OSS_120B,
            "gpt-oss-120b MXFP4 on a 24 GB GPU over PCIe 4.0 x16: 25 GB/s pinned copies; compute from ~0.8 TB/s "
            "effective memory bandwidth (decode) and ~80 TFLOP/s (prefill). Estimates, not measurements.",
            attn_ms=0.075, attn_ms_per_token=0.0007, expert_ms=0.025, expert_ms_per_token=0.0006, head_ms=1.5,
            gpu_memory_gb=24.0, non_expert_gb=5.0, **pcie4,
        ),
        # gpt-oss-120b on a 32 GB GPU over PCIe 5.0 (RTX 5090 class: ~1.8 TB/s GDDR7)
        "gpt-oss-120b-32gb": _gpt_oss_preset(
            "gpt-oss-120b-32gb", GPT_OSS_120B,
            "gpt-oss-120b MXFP4 on a 32 GB GPU over PCIe 5.0 x16: 50 GB/s pinned copies; compute from ~1.4 TB/s "
            "effective memory bandwidth (decode) and ~200 TFLOP/s (prefill). Estimates, not measurements.",
            h2d_gbps=50.0, h2d_latency_us=8.0, attn_ms=0.045, attn_ms_per_token=0.0003, expert_ms=0.015,
            expert_ms_per_token=0.00025, head_ms=0.85, sched_ms=0.1, gpu_memory_gb=32.0, non_expert_gb=5.0,
        ),
    }


def _presets() -> dict[str, HardwareProfile]:
    return {**_mixtral_and_qwen3_presets(), **_family_presets(), **_gpt_oss_presets()}


def _mixtral_and_qwen3_presets() -> dict[str, HardwareProfile]:
    return {
        # PCIe 4.0 x16 (~25 GB/s pinned in practice), a 24 GB consumer GPU (~1 TB/s HBM, RTX 3090/4090 class)
        "pcie4-24gb": _mixtral_preset(
            "pcie4-24gb",
            "Mixtral-8x7B AWQ on a 24 GB GPU over PCIe 4.0 x16: 25 GB/s pinned copies; compute from ~0.8 TB/s "
            "effective memory bandwidth (decode) and ~80 TFLOP/s (prefill). Estimates, not measurements."
            + CPU_NOTE.format(**DESKTOP_CPU),
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.12, attn_ms_per_token=0.002, expert_ms=0.13,
            expert_ms_per_token=0.0045, head_ms=0.35, sched_ms=0.15, gpu_memory_gb=24.0, non_expert_gb=4.3,
            **DESKTOP_CPU,
        ),
        # H100 PCIe: PCIe 5.0 x16 (~50 GB/s pinned), 80 GB HBM2e at 2 TB/s
        "h100-pcie5": _mixtral_preset(
            "h100-pcie5",
            "Mixtral-8x7B AWQ on an H100 PCIe (80 GB) over PCIe 5.0 x16: 50 GB/s pinned copies; compute from "
            "~1.6 TB/s effective HBM bandwidth (decode) and ~250 TFLOP/s (prefill). Estimates, not measurements."
            + CPU_NOTE.format(**SERVER_CPU),
            h2d_gbps=50.0, h2d_latency_us=8.0, attn_ms=0.065, attn_ms_per_token=0.0008, expert_ms=0.065,
            expert_ms_per_token=0.0015, head_ms=0.18, sched_ms=0.1, gpu_memory_gb=80.0, non_expert_gb=6.0,
            **SERVER_CPU,
        ),
        # Qwen3-30B-A3B (AWQ experts and attention) on a 12 GB PCIe 4.0 card (~0.45 TB/s effective, RTX 4070
        # class): an expert reads 2.5 MB (5.5 us) plus its share of the layer's one grouped launch; attention
        # 10 MB of int4 weights per layer; the fp16 LM head (151,936 x 2048) reads 0.62 GB per token.
        # Non-expert memory: attention 0.5 GB + embeddings and head 1.24 GB + 4k-token KV 0.38 GB + workspace.
        "qwen3-30b-pcie4-12gb": _shaped_preset(
            QWEN3_30B_A3B, "qwen3-30b-pcie4-12gb",
            "Qwen3-30B-A3B AWQ (48 layers x 128 experts, top-8, 2.3 MiB per expert) on a 12 GB GPU over PCIe 4.0 x16: "
            "25 GB/s pinned copies; compute from ~0.45 TB/s effective memory bandwidth (decode) and ~40 TFLOP/s "
            "(prefill). Estimates, not measurements.",
            h2d_gbps=25.0, h2d_latency_us=10.0, attn_ms=0.05, attn_ms_per_token=0.001, expert_ms=0.009,
            expert_ms_per_token=0.00024, head_ms=1.4, sched_ms=0.15, gpu_memory_gb=12.0, non_expert_gb=2.5,
        ),
        # Qwen3-235B-A22B (AWQ experts and attention) on an H100 PCIe: 9.7 MB per expert (6 us at 1.6 TB/s);
        # attention 38 MB of int4 weights per layer; LM head 1.24 GB fp16. 117 GB of experts: they cannot all fit.
        "qwen3-235b-h100-pcie5": _shaped_preset(
            QWEN3_235B_A22B, "qwen3-235b-h100-pcie5",
            "Qwen3-235B-A22B AWQ (94 layers x 128 experts, top-8, 9.4 MiB per expert) on an H100 PCIe (80 GB) over "
            "PCIe 5.0 x16: 50 GB/s pinned copies; compute from ~1.6 TB/s effective HBM bandwidth (decode) and "
            "~250 TFLOP/s (prefill). Estimates, not measurements.",
            h2d_gbps=50.0, h2d_latency_us=8.0, attn_ms=0.04, attn_ms_per_token=0.0006, expert_ms=0.008,
            expert_ms_per_token=0.00015, head_ms=0.8, sched_ms=0.1, gpu_memory_gb=80.0, non_expert_gb=7.3,
        ),
    }


PRESET_NAMES = ("pcie4-24gb", "h100-pcie5", "qwen3-30b-pcie4-12gb", "qwen3-235b-h100-pcie5", "deepseek-v3-pcie4-24gb",
                "glm45-air-pcie4-24gb", "minimax-m2-pcie4-24gb", "qwen3-next-pcie4-16gb", "gpt-oss-20b-12gb",
                "gpt-oss-120b-24gb", "gpt-oss-120b-32gb")


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
