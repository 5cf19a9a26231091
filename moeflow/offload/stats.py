"""Counters of what the expert scheduler did, per phase (prefill / decode)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeflow.offload.disk_store import DiskStats

PHASES = ("prefill", "decode")


@dataclass
class PhaseStats:
    hits: int = 0  # needed experts already resident (or landed from a prefetch) at the gate
    inflight_hits: int = 0  # hits whose prefetch was still in flight at the gate (compute may have waited)
    misses: int = 0  # needed experts that had to be loaded after the gate
    prefetches: int = 0  # experts copied ahead of their gate
    useful_prefetches: int = 0  # prefetched experts that were used before being evicted
    timely_prefetches: int = 0  # of those, the ones whose bytes had landed at their gate (ProMoE's FetchRate)
    wasted_prefetches: int = 0  # prefetched experts evicted (or dropped) unused
    gated_prefetches: int = 0  # guesses the bandwidth-aware prefetch gate turned away (Mechanisms.prefetch_gate)
    bytes_h2d: int = 0  # host -> device bytes moved
    copies: int = 0  # copy operations handed to the transport (one cudaMemcpyAsync each)
    copy_batches: int = 0  # transport calls, each completing on one handle (one CUDA event)
    stall_s: float = 0.0  # time the compute waited on copies
    steps: int = 0  # forward passes in this phase
    tokens: int = 0  # tokens processed in this phase
    time_s: float = 0.0  # wall time spent in this phase
    # hybrid execution (docs/hybrid.md): misses computed on the CPU instead of (or racing) their copy
    cpu_experts: int = 0  # expert computations whose CPU result was used
    cpu_s: float = 0.0  # CPU worker seconds spent on expert compute (results used or not)
    cpu_races: int = 0  # experts started both ways (copy and CPU), first finisher used
    cpu_race_wins: int = 0  # of those, how many the CPU won
    cpu_race_cancels: int = 0  # of those, the loads cancelled with chunks still queued (their slot freed)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def ready_hit_rate(self) -> float:
        """Hits whose bytes were in place at the gate (in-flight loads not counted) over needed experts."""
        total = self.hits + self.misses
        return (self.hits - self.inflight_hits) / total if total else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """ProMoE's Accuracy (§4.1): prefetched experts that were needed at their gate / experts prefetched."""
        return self.useful_prefetches / self.prefetches if self.prefetches else 0.0

    @property
    def fetch_rate(self) -> float:
        """ProMoE's FetchRate (§4.1): correct prefetches that landed before their gate / correct prefetches."""
        return self.timely_prefetches / self.useful_prefetches if self.useful_prefetches else 0.0

    @property
    def goodpred(self) -> float:
        """ProMoE's GoodPred = Accuracy x FetchRate (§4.1): prefetches both correct and in time / prefetches."""
        return self.timely_prefetches / self.prefetches if self.prefetches else 0.0


@dataclass
class DraftPrefetchStats:
    """MTP speculation's draft-informed prefetch (:mod:`moeflow.engine.mtp_prefetch`), in (MoE layer, expert) pairs
    of the verify passes: ``predicted`` (the experts the drafts' proxies route to), ``queued`` (of those, the ones not
    in place whose copy was queued before the pass), ``needed`` (the pairs the verify passes used), ``predicted_used``
    (predicted and used) and ``queued_used`` (queued and used: at most the copies the pass found moved or moving
    ahead, since a queued copy may be evicted by a later one before its layer; the cache's ``useful_prefetches`` and
    ``timely_prefetches`` count what was found, every prefetch together)."""

    predicted: int = 0
    queued: int = 0
    needed: int = 0
    predicted_used: int = 0
    queued_used: int = 0

    @property
    def recall(self) -> float | None:
        """The share of the verify passes' experts the prediction named."""
        return self.predicted_used / self.needed if self.needed else None

    @property
    def precision(self) -> float | None:
        """The share of the predicted experts the verify passes used."""
        return self.predicted_used / self.predicted if self.predicted else None

    @property
    def queued_used_rate(self) -> float | None:
        """The share of the queued copies the verify passes routed to."""
        return self.queued_used / self.queued if self.queued else None


@dataclass
class Stats:
    """``model.stats``: per-phase counters plus request-level timings."""

    prefill: PhaseStats = field(default_factory=PhaseStats)
    decode: PhaseStats = field(default_factory=PhaseStats)
    phase: str = "prefill"  # the phase the counters currently go to
    ttft_s: float | None = None  # time to first token of the last generate() call
    tpot_s: float | None = None  # mean time per output token after the first
    peak_gpu_bytes: int = 0
    expert_pool_bytes: int = 0  # device expert slot pool (set by the offloading backend)
    host_store_bytes: int = 0  # host copy of every expert
    host_pinned: bool = False  # whether the host store is page-locked (else copies are synchronous, slower)
    # prompt lookup decoding (generate(prompt_lookup_num_tokens=...)): draft tokens verified / kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # the disk tier's counters (the DiskHostStore's own object) when experts are read from disk, else None
    disk: DiskStats | None = None
    # MTP speculation (generate(num_speculative_tokens=...)): tokens generated, the first one included
    generated_tokens: int = 0
    # MTP speculation: the verify passes' experts prefetched from the drafts
    draft_prefetch: DraftPrefetchStats = field(default_factory=DraftPrefetchStats)

    def current(self) -> PhaseStats:
        """The counters of the current phase."""
        return self.prefill if self.phase == "prefill" else self.decode

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase

    def reset(self) -> None:
        """Clear the counters and timings (the memory layout fields describe the backend and stay)."""
        self.prefill, self.decode = PhaseStats(), PhaseStats()
        self.phase, self.ttft_s, self.tpot_s, self.peak_gpu_bytes = "prefill", None, None, 0
        self.draft_tokens = self.accepted_tokens = self.generated_tokens = 0
        self.draft_prefetch = DraftPrefetchStats()
        if self.disk is not None:
            self.disk.reset()

    @property
    def bytes_per_generated_token(self) -> float | None:
        """Host -> device bytes moved while decoding per token decoded after the first (``generated_tokens``
        counted by the MTP speculation loop; None before it counted two)."""
        return self.decode.bytes_h2d / (self.generated_tokens - 1) if self.generated_tokens > 1 else None

    @property
    def hit_rate(self) -> float:
        hits = self.prefill.hits + self.decode.hits
        total = hits + self.prefill.misses + self.decode.misses
        return hits / total if total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        for phase, st in (("prefill", self.prefill), ("decode", self.decode)):
            d[phase].update(hit_rate=st.hit_rate, ready_hit_rate=st.ready_hit_rate,
                            prefetch_accuracy=st.prefetch_accuracy, fetch_rate=st.fetch_rate, goodpred=st.goodpred)
        d["hit_rate"] = self.hit_rate
        return d

    def summary(self) -> str:
        ttft = f"{self.ttft_s * 1e3:.1f} ms" if self.ttft_s is not None else "n/a"
        tps = f"{1.0 / self.tpot_s:.1f} tok/s" if self.tpot_s else "n/a"
        moved = (self.prefill.bytes_h2d + self.decode.bytes_h2d) / 2**20
        stall = (self.prefill.stall_s + self.decode.stall_s) * 1e3
        return (
            f"TTFT {ttft} | decode {tps} | expert hit rate {self.hit_rate:.1%} "
            f"(prefill {self.prefill.hit_rate:.1%}, decode {self.decode.hit_rate:.1%}) | "
            f"{moved:.1f} MiB host->device | stall {stall:.1f} ms"
            + (f" | peak GPU {self.peak_gpu_bytes / 2**30:.2f} GiB" if self.peak_gpu_bytes else "")
            + (f" | {self.prefill.cpu_experts + self.decode.cpu_experts} experts on the CPU "
               f"({(self.prefill.cpu_s + self.decode.cpu_s) * 1e3:.1f} ms)"
               if self.prefill.cpu_experts + self.decode.cpu_experts else "")
            + (f" | drafts {self.accepted_tokens}/{self.draft_tokens} accepted" if self.draft_tokens else "")
            + (self._disk_summary() if self.disk is not None else "")
        )

    def _disk_summary(self) -> str:
        d = self.disk
        return (f" | disk tier: {d.bytes_read / 2**20:.1f} MiB read ({d.reads} experts, {d.prefetch_reads} ahead "
                f"of need), host tier hits {d.hits} / misses {d.misses}, disk stall {d.stall_s * 1e3:.1f} ms")
