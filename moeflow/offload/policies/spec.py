"""What a named offload policy is: a :class:`PolicySpec` (the scheduler's parts) over a :class:`PolicyContext`.

Every paper's system is one spec, so every policy runs on the same model, prompts and memory budget. A spec
names each part once: the eviction policy and the predictor are factories of the context (the predictor is
built first, so an eviction policy may rank by it); there is no field that overrides another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from moeflow.errors import SchedulingError
from moeflow.offload.eviction import EvictionPolicy, make_eviction

if TYPE_CHECKING:
    from moeflow.config import OffloadConfig
    from moeflow.moe.decode import DecodeStrategyFactory
    from moeflow.offload.predictors.interface import Predictor


@dataclass(frozen=True)
class Mechanisms:
    """Where a paper's mechanism as written and moeflow's variant of it differ, which one runs (docs/papers.md).

    Each field names the paper it comes from; a policy's spec sets its defaults and
    ``OffloadConfig.policy_options`` overrides them by name, so both can be compared on the same model.

    refresh_on_prefetch: a predicted expert that is already cached has its recency refreshed (ProMoE's per-layer
        LRU: the prefetch touches the cache); False: only gate accesses and loads count as uses.
    prefetch_chunks: how a predicted (low-priority) load is cut for the copy queue: "pieces", equal pieces of
        at most ``PREFETCH_CHUNK_BYTES`` (at least ``copy_chunks``); "per-linear", one chunk per linear layer of
        the expert (ProMoE §5.1: gate, up, down; an AWQ expert's fused gate/up panels are one chunk).
    queue_priority: the predictor's prefetch priority (FineMoE §4.5: p / (l - l_now)) orders the copy engine's
        low queue; False: predicted loads queue in arrival order (already ranked by the predictor per layer).
    prefill_iteration: FineMoE's expert-map iteration in a prefill: "pass", the whole prefill is one iteration
        (one map of the mean probabilities and embedding, the paper's); "token", one map per prompt token.
    predict_in_prefill: run the predictor (observe, propose, prefetch) in prefill passes; False: prefill streams
        the gate's experts only (DuoServe §5.2: its predictor serves decode).
    keep_contiguous: ExpertFlow's token scheduler (§3.3) keeps the contiguous split of the rows where its
        clustering does not activate fewer (layer, expert) pairs (moeflow's variant); False: the balanced k-means
        clustering as the paper takes it (§3.3.3). Applies where the policy's decode strategy forms micro-batches
        (``generate(micro_batch_size=...)`` under expertflow: the prefill's and every decode round's).
    prefill_regroup: ExpertFlow's token scheduler (§3.3) on the tokens of a prefill of several prompts: each MoE
        layer of the pass computes its experts for two balanced token micro-batches, the tokens of all prompts
        regrouped by the Hamming similarity of their predicted routing paths (attention stays one pass over whole
        prompts, so every token keeps its context); False: one group of every token (moeflow's: the layer schedule
        loads each needed expert once per layer, so one group loads no more; measured in docs/papers.md). Read by
        policies whose predictor forms token groups (expertflow).
    prefetch_gate: beyond the papers (issue 41): queue a predicted load only where its expected benefit (the
        predictor's online accuracy at the guess's rank x the share of the copy that lands before its layer,
        from the copy engine's backlog and the measured layer period) pays for its link time
        (:mod:`moeflow.offload.prefetch_gate`); False: every guess a free slot can take (the papers').
    """

    refresh_on_prefetch: bool = False
    prefetch_chunks: Literal["pieces", "per-linear"] = "pieces"
    queue_priority: bool = False
    prefill_iteration: Literal["token", "pass"] = "token"
    predict_in_prefill: bool = True
    keep_contiguous: bool = True
    prefill_regroup: bool = False
    prefetch_gate: bool = False

    def __post_init__(self) -> None:
        if self.prefetch_chunks not in ("pieces", "per-linear"):
            raise SchedulingError(f"policy option prefetch_chunks={self.prefetch_chunks!r}: expected 'pieces' or "
                                  "'per-linear'")
        if self.prefill_iteration not in ("token", "pass"):
            raise SchedulingError(f"policy option prefill_iteration={self.prefill_iteration!r}: expected 'token' "
                                  "or 'pass'")
        for name, value in (("refresh_on_prefetch", self.refresh_on_prefetch), ("queue_priority", self.queue_priority),
                            ("predict_in_prefill", self.predict_in_prefill), ("keep_contiguous", self.keep_contiguous),
                            ("prefill_regroup", self.prefill_regroup), ("prefetch_gate", self.prefetch_gate)):
            if not isinstance(value, bool):
                raise SchedulingError(f"policy option {name}={value!r}: expected True or False")

    def with_options(self, options: Mapping[str, Any] | None) -> Mechanisms:
        """These mechanisms with ``options`` (``OffloadConfig.policy_options``) applied; SchedulingError naming an
        unknown option and the known ones."""
        if not options:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise SchedulingError(f"OffloadConfig.policy_options: unknown option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **options)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy's factories may build from."""

    config: OffloadConfig
    num_layers: int
    num_experts: int
    top_k: int
    n_slots: int
    ring_slots: int
    gates: Sequence[nn.Module]  # one router per MoE layer: x [T, H] -> logits [T, E]
    device: torch.device | str
    # the model's directory (predictor policies look for predictors/<kind>.pt there)
    checkpoint_dir: str | Path | None = None
    route: Callable | None = None  # the family's routing (logits -> probs, ids, weights); None: softmax-top-k
    # the policy's predictor, set before ``eviction`` is called (FineMoE's eviction uses it)
    predictor: Predictor | None = None
    mechanisms: Mechanisms = Mechanisms()  # the spec's, with OffloadConfig.policy_options applied


def evict(name: str) -> Callable[[PolicyContext], EvictionPolicy]:
    """The factory of a named eviction policy ("lru", "lfu", "static": see :mod:`moeflow.offload.eviction`)."""
    def make(ctx: PolicyContext) -> EvictionPolicy:
        return make_eviction(name, n_slots=ctx.n_slots, ring_slots=ctx.ring_slots)
    make.__name__ = f"evict_{name}"
    return make


@dataclass(frozen=True)
class PolicySpec:
    """One named policy.

    offload: False keeps every expert resident (``ResidentExperts``); the other fields then do not apply.
    eviction / predictor: factories of the context (predictor None: no prefetching).
    retain: keep experts in their slots after use (False: accelerate-style on-demand).
    warm_start: fill the empty pool at load time instead of starting cold.
    per_layer: partition the pool, ``n_slots // num_layers`` slots per layer (when that is >= 1).
    prefill_ring: in prefill at most top-k of a layer's loads hold slots at once (DuoServe's k-slot ring).
    cpu_compute: the policy's own hybrid mode (used when ``OffloadConfig.cpu_compute`` is None); a policy
        that sets it cannot run with ``cpu_compute="never"``.
    select: for "auto" only: the name of the policy to run, chosen from the context.
    mechanisms: the paper-or-variant switches (:class:`Mechanisms`), overridden by ``OffloadConfig.policy_options``.
    decode: the policy's decode strategy for ``generate(micro_batch_size=...)`` (``generate(dual_batch=...)``
        chooses; :mod:`moeflow.moe.decode`), made per call from the loop; None: the engine's plain loop.
    """

    name: str
    description: str = ""
    offload: bool = True
    eviction: Callable[[PolicyContext], EvictionPolicy] = evict("lru")
    predictor: Callable[[PolicyContext], Predictor] | None = None
    retain: bool = True
    warm_start: bool = True
    per_layer: bool = False
    prefill_ring: bool = False
    cpu_compute: str | None = None
    select: Callable[[PolicyContext], str] | None = None
    mechanisms: Mechanisms = Mechanisms()
    decode: DecodeStrategyFactory | None = None
