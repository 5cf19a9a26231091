"""Routing statistics of a trace, the ones published analyses of MoE routing report, so a reader can judge how
realistic a model's routing is (docs/papers.md):

* **load skew** per layer: the busiest expert's share of the top-k slots over the mean share (1 = perfectly
  balanced), the share the busiest 10 % of experts take, and the usage entropy over log E (1 = uniform);
* **temporal locality**: the share of a token's k experts that the previous token of the same sequence also
  used, per layer, beside what independent uniform routing gives (k / E);
* **inter-layer affinity**: recall of the k experts of layer l + 1 guessed from layer l's experts alone (the k
  most frequent successors in the trace's own co-occurrence table, DuoServe's A_{l,l+1}), beside the recall of
  layer l + 1's k most popular experts.
"""

from __future__ import annotations

import math

import torch

from moeflow.trace.format import Trace


def routing_stats(trace: Trace) -> dict:
    """The statistics of the module docstring over every row of ``trace`` (prefill and decode)."""
    ids = trace.topk_ids.long()  # [N, L, k]
    mask = trace.topk_mask()  # [N, L, E] bool
    n, n_layers, k = ids.shape
    n_experts = mask.shape[-1]
    counts = mask.sum(0).double()  # [L, E]
    share = counts / counts.sum(-1, keepdim=True)
    top10 = max(1, round(n_experts / 10))
    entropy = -(share * share.clamp_min(1e-30).log()).sum(-1) / math.log(n_experts)
    # consecutive rows of one sequence (the trace stores a sequence's rows in order)
    same_seq = trace.seq_id[1:] == trace.seq_id[:-1]
    shared = (mask[1:] & mask[:-1]).sum(-1).double()  # [N-1, L]
    reuse = (shared[same_seq].sum(0) / (same_seq.sum() * k)).tolist() if bool(same_seq.any()) else [0.0] * n_layers
    affinity, popularity = [], []
    maskf = mask.double()
    for layer in range(n_layers - 1):
        table = maskf[:, layer].T @ maskf[:, layer + 1]  # [E, E]: co-occurrences of (e at l, e' at l+1)
        scores = maskf[:, layer] @ table  # [N, E]: successors of each row's experts, summed
        guess = torch.zeros_like(mask[:, layer + 1]).scatter_(1, scores.topk(k, dim=-1).indices, True)
        affinity.append(float((guess & mask[:, layer + 1]).sum() / (n * k)))
        pop = counts[layer + 1].topk(k).indices
        popularity.append(float(mask[:, layer + 1, pop].sum() / (n * k)))
    return {
        "rows": n, "layers": n_layers, "experts": n_experts, "top_k": k,
        "max_over_mean_share": [round(v, 3) for v in (share.max(-1).values * n_experts).tolist()],
        "top10pct_share": [round(v, 4) for v in share.sort(-1, descending=True).values[:, :top10].sum(-1).tolist()],
        "usage_entropy_fraction": [round(v, 4) for v in entropy.tolist()],
        "consecutive_reuse": [round(v, 4) for v in reuse],
        "consecutive_reuse_uniform": round(k / n_experts, 4),
        "affinity_recall": [round(v, 4) for v in affinity],
        "popularity_recall": [round(v, 4) for v in popularity],
    }
