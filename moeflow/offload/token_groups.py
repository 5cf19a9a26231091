"""ExpertFlow's token scheduler (§3.3) on the tokens of one pass: an MoE layer computed token micro-batch by token
micro-batch (``Mechanisms.prefill_regroup``; the groups come from the predictor, ``Predictor.token_groups``).

The paper regroups the tokens of two batches into two balanced batches by the Hamming similarity of their routing
paths, so that each batch activates fewer experts. In a prefill of several prompts that means tokens of different
prompts in one micro-batch; attention needs each token's whole prompt, so here only the MoE part of each layer is
regrouped: attention runs once over whole prompts, then the layer's experts are scheduled (steps 3-5 of
:mod:`moeflow.offload.backend`) for one token micro-batch after the other, each with only the experts its tokens
need, and the outputs go back to the tokens' places. The layer's gate (step 2: early preemption) runs once, with
every token's experts, so no micro-batch drops another's prefetch. Every token's output is its own experts' sum,
as in one group (the exact-token invariant: tests/test_prefill_regroup.py).

Hits and misses are counted per micro-batch: an expert two micro-batches need is accessed twice (a hit the second
time when it stayed in its slot), so compare runs by experts loaded / bytes moved, not by hit rate alone.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moeflow.errors import SchedulingError
from moeflow.offload.compute import LayerCompute
from moeflow.offload.stats import PhaseStats


class GroupedLayers(Protocol):
    """The offload backend's side a layer computed in token micro-batches uses (``OffloadedExperts``)."""

    compute: LayerCompute

    def gate_layer(self, layer: int, needed: list[int]) -> None: ...

    def _schedule_and_compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              needed: list[int], guesses: list[tuple[int, list[int]]], st: PhaseStats,
                              out: torch.Tensor | None = None, early: tuple[int, ...] = (),
                              gate: bool = True) -> torch.Tensor: ...


def forward_token_groups(backend: GroupedLayers, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, needed: list[int], guesses: list[tuple[int, list[int]]],
                         st: PhaseStats, groups: list[list[int]]) -> torch.Tensor:
    """One MoE layer of real tokens x [T, H] (topk_ids int [T, k], topk_weights fp32 [T, k]; ``needed``: the
    layer's experts, sorted) computed group by group -> [T, H]. ``groups``: index lists into the T tokens that
    together cover each token once (a SchedulingError names the mismatch otherwise)."""
    n = x.shape[0]
    covered = sorted(i for g in groups for i in g)
    if covered != list(range(n)):
        raise SchedulingError(f"MoE layer {layer}: the token micro-batches cover {len(covered)} token indices "
                              f"(range {covered[:1]}..{covered[-1:]}), the layer has {n} real tokens: the predictor's "
                              "token_groups must index this pass's real tokens, each once")
    k = topk_ids.shape[1]
    backend.gate_layer(layer, needed)
    host_ids = topk_ids.cpu()
    y = x.new_empty(x.shape)
    for group in groups:
        if not group:
            continue
        index = torch.tensor(group, dtype=torch.long)
        part_needed = sorted(set(host_ids[index].reshape(-1).tolist()))
        rows = index.to(x.device)
        part = backend._schedule_and_compute(layer, x[rows], topk_ids[rows], topk_weights[rows], part_needed,
                                             guesses, st, gate=False)
        y[rows] = backend.compute.combine(part, k)
    return y
