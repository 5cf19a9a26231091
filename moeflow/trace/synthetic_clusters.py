"""A synthetic routing trace whose inter-layer structure is known, for tests and benchmarks.

Every token belongs to one of ``num_clusters`` hidden "topics" (a sequence mostly sticks to one).
A topic c has a unit direction u_c (orthonormal across topics) and, at every layer l, a fixed set
S(l, c) of k experts. Layer l's router is ``W_l = beta * sum_c onehot(S(l, c)) u_c^T`` (plus small
noise); a token's MoE input at layer l is ``u_c`` plus noise that drifts from layer to layer, as a
residual stream does. So the routing of each layer is (nearly) a function of the topic, which
the routing path, the hidden state and the embedding all reveal: a predictor that uses any of
them can reach near-perfect recall, while layer popularity, blind to the topic, cannot.
"""

from __future__ import annotations

import torch

from moeflow.moe import route
from moeflow.tracing import DECODE, PREFILL, Trace


def synthetic_trace(
    num_sequences: int = 40,
    tokens_per_sequence: int = 32,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    hidden_size: int = 32,
    num_clusters: int = 6,
    noise: float = 0.25,
    beta: float = 6.0,
    stickiness: float = 0.7,
    seed: int = 0,
) -> tuple[Trace, torch.Tensor]:
    """(trace with hidden and embed, router weights [L, E, H]). The first half of each sequence is
    marked prefill, the rest decode."""
    if hidden_size < num_clusters:
        raise ValueError(f"hidden_size={hidden_size} must be >= num_clusters={num_clusters}")
    g = torch.Generator().manual_seed(seed)
    L, E, k, H, C = num_layers, num_experts, top_k, hidden_size, num_clusters
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=g))
    centers = q[:, :C].T.contiguous()  # [C, H] orthonormal
    # S(l, c): k experts per topic and layer, ordered (the first gets the largest logit)
    sets = torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(C)]) for _ in range(L)])
    rank_weight = torch.linspace(1.0, 0.8, k)
    gates = 0.05 * torch.randn(L, E, H, generator=g)
    for layer in range(L):
        for c in range(C):
            gates[layer, sets[layer, c]] += beta * rank_weight[:, None] * centers[c][None, :]
    n = num_sequences * tokens_per_sequence
    seq_id = torch.arange(num_sequences, dtype=torch.int32).repeat_interleave(tokens_per_sequence)
    main_topic = torch.randint(0, C, (num_sequences,), generator=g)
    own = torch.rand(n, generator=g) < stickiness
    topic = torch.where(own, main_topic.repeat_interleave(tokens_per_sequence), torch.randint(0, C, (n,), generator=g))
    hidden = torch.empty(n, L, H)
    h = centers[topic] + noise * torch.randn(n, H, generator=g)
    embed = centers[topic] + noise * torch.randn(n, H, generator=g)
    probs = torch.empty(n, L, E)
    topk = torch.empty(n, L, k, dtype=torch.int32)
    for layer in range(L):
        hidden[:, layer] = h
        p, ids, _ = route(h @ gates[layer].T, k)
        probs[:, layer], topk[:, layer] = p, ids
        h = h + 0.5 * noise * torch.randn(n, H, generator=g)  # residual drift
    pos = torch.arange(tokens_per_sequence, dtype=torch.int32).repeat(num_sequences)
    phase = torch.where(pos < tokens_per_sequence // 2, PREFILL, DECODE).to(torch.int8)
    trace = Trace(
        topk_ids=topk, probs=probs.half(), token_ids=(topic * 10 + pos % 10).to(torch.int32), seq_id=seq_id, pos=pos,
        phase=phase, hidden=hidden.half(), embed=embed.half(), num_layers=L, num_experts=E, top_k=k,
        hidden_size=H, model=f"synthetic(seed={seed})",
    )
    return trace, gates
