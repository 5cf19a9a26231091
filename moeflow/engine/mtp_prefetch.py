"""MTP speculation's draft-informed prefetch (issue 40, point 3): the verify pass's experts queued from its drafts.

A verify pass runs the main model over the last kept token and the k drafts. Their tokens are known when the MTP
layers have drafted, before the pass; their routing is not (it needs each position's hidden state at each MoE layer,
which only the pass computes). So each main MoE layer's router is applied to a cheap proxy of each verify position's
layer input, and the experts it picks are queued through the expert backend's prefetch
(:meth:`~moeflow.moe.backend.ExpertBackend.prefetch`, the low-priority loads the predictive policies use), so their
copies overlap the pass's earlier layers. Proxies (``generate(mtp_prefetch=...)``):

* ``"mtp"``: the MTP layer's output (its block's residual, before ``shared_head.norm``) at the MTP position that
  took the verify position's token as input: the last kept token's (the drafting pass over the kept positions) and
  each draft's but the last (the chained passes); the last draft, which no MTP pass took, by its embedding;
* ``"mtp-only"``: as ``"mtp"``, the last draft not predicted;
* ``"embed"``: every position by its token embedding.

Each proxy row is scaled to unit RMS (the routers read the post-attention norm's output) and routed by the layer's
own router (``MoEBlock.route(gate(x))``: the group-limited, bias-corrected choice included). Per layer the union of
the rows' top-k is queued, most-chosen first. The prefetch changes which copies are under way, never a computed
value, so the tokens stay plain greedy's. ``stats.draft_prefetch`` counts the predictions against the verify pass's
routing (:class:`~moeflow.offload.stats.DraftPrefetchStats`).

Measured (benchmarks/results/mtp/README.md, session 16): on the trained DeepSeek-V3-shaped model the ``"mtp"`` proxy
is the best cheap one (a token's top-4 named 38 % of the time, chance 12.5 %), and no proxy, not even the verify
pass's exact experts, lowers the bytes or the simulated time per token at 25 % / 50 % of the experts: the copies
only move earlier while the pass-wide request takes slots from experts the pass would have hit. Hence off by
default (``generate(mtp_prefetch=None)``).
"""

from __future__ import annotations

import torch

from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import MoEBlock, RoutingRecorder
from moeflow.offload.stats import DraftPrefetchStats

PROXIES = ("mtp", "mtp-only", "embed")


def check_proxy(proxy: object) -> None:
    """Refuse an ``mtp_prefetch`` value that names no proxy."""
    if proxy is not None and proxy not in PROXIES:
        raise ValueError(f"mtp_prefetch must be one of {PROXIES} or None, got {proxy!r}")


class DraftPrefetcher:
    """Predicts and queues one verify pass's experts per main MoE layer (``blocks``: the decoder's MoE blocks in
    layer order; ``embed``: the token embedding, ids [1, T] -> [1, T, H])."""

    def __init__(self, blocks: list[MoEBlock], embed: torch.nn.Module, backend: ExpertBackend, proxy: str) -> None:
        check_proxy(proxy)
        self.blocks, self.embed, self.backend, self.proxy = blocks, embed, backend, proxy
        self.predicted: list[set[int]] = []
        self.queued: list[set[int]] = []

    def proxies(self, ids: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        """ids [T] of the verify pass (the last kept token, then the drafts); states: the MTP layer's outputs [H]
        for its first positions (the last kept token's, then the drafts' but the last; fewer or none when the
        drafts came from elsewhere) -> proxy rows [R, H] (R = T, or T - 1 for ``"mtp-only"``)."""
        embeds = self.embed(ids[None])[0]
        if self.proxy == "embed":
            return embeds
        rows = [states[j] if j < len(states) else embeds[j] for j in range(ids.shape[0])]
        if self.proxy == "mtp-only":
            rows = rows[:-1] or rows
        return torch.stack([r.to(embeds.dtype) for r in rows])

    @torch.no_grad()
    def prefetch(self, ids: torch.Tensor, states: list[torch.Tensor]) -> None:
        """Route the proxies of the verify pass over ids [T] (see :meth:`proxies`) through every main MoE layer's
        router and queue the union of each layer's picks (most rows first, then the larger summed score)."""
        x = self.proxies(ids, states)
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        self.predicted, self.queued = [], []
        for block in self.blocks:
            probs, top, _ = block.route(block.gate(x))
            picked = top.reshape(-1).long()
            votes = torch.bincount(picked, minlength=probs.shape[-1]).float()
            score = torch.zeros_like(votes).scatter_add_(0, picked, probs.float().gather(1, top.long()).reshape(-1))
            order = [int(e) for e in torch.argsort(votes * 1e3 + score, descending=True) if votes[e] > 0]
            self.predicted.append(set(order))
            self.queued.append(set(self.backend.prefetch(block.layer_idx, order, 0)))

    def count(self, stats: DraftPrefetchStats, routing: RoutingRecorder) -> None:
        """Add the verify pass's outcome (``routing``: its recorded top-k per MoE layer, [1, T, k]) to ``stats``:
        every position's experts count as needed (a rejected draft's experts were moved and computed as well)."""
        for layer, (predicted, queued) in enumerate(zip(self.predicted, self.queued, strict=True)):
            ids = routing.topk_ids[layer]
            if ids is None:
                raise RuntimeError(f"the verify pass recorded no routing for MoE layer {layer}")
            used = {int(e) for e in ids.reshape(-1).tolist() if e >= 0}
            stats.predicted += len(predicted)
            stats.queued += len(queued)
            stats.needed += len(used)
            stats.predicted_used += len(predicted & used)
            stats.queued_used += len(queued & used)
