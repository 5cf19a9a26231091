"""Synthetic routing traces with their routers, for tests, benchmarks and the simulator (no model run needed).

Routing is always the router's softmax top-k on the trace's own hidden states (``moeflow.moe.route``), as the
model computes it, so the routers returned with a trace make speculation policies simulable. Two hidden-state
models, for the two questions asked of a synthetic trace:

* :func:`synthetic_trace` (topics): every token belongs to one of ``num_clusters`` hidden "topics" (a sequence
  mostly sticks to one). A topic c has a unit direction u_c (orthonormal across topics) and, at every layer l,
  a fixed set S(l, c) of k experts. Layer l's router is ``W_l = beta * sum_c onehot(S(l, c)) u_c^T`` (plus
  small noise); a token's MoE input at layer l is ``u_c`` plus noise that drifts from layer to layer, as a
  residual stream does. The routing of each layer is (nearly) a function of the topic, which the routing
  path, the hidden state, the embedding and the token id all reveal: a predictor that uses any of them can
  reach near-perfect recall, while layer popularity, blind to the topic, cannot (the predictor tests).
* :func:`synthesize_trace` (drift): any model shape (e.g. Mixtral-8x7B's), imitating three properties real
  routing has and offloading policies exploit: skew (a per-layer logit bias), temporal locality (consecutive
  tokens' hidden states are related) and a residual stream (layer l+1's input is layer l's plus a
  perturbation, so layer l+1's router on layer l's input is a good but imperfect guess). It is NOT real
  routing; the simulator runs on it where no real trace of a model exists.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.moe import route
from moeflow.trace.format import DECODE, PREFILL, Trace


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


def synthesize_trace(
    num_layers: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    hidden_size: int = 64,
    sequences: int = 4,
    prompt_len: int = 48,
    new_tokens: int = 33,
    seed: int = 0,
    layer_drift: float = 0.5,
    token_drift: float = 0.6,
    skew: float = 1.0,
    model: str = "synthetic",
) -> tuple[Trace, list[torch.Tensor]]:
    """(trace, router weights [E, H] per layer). A sequence has ``prompt_len`` prefill rows and
    ``new_tokens - 1`` decode rows (the trace format's convention: the last token is never fed back)."""
    g = torch.Generator().manual_seed(seed)
    H, L, E = hidden_size, num_layers, num_experts
    gates = [torch.randn(E, H, generator=g) * 2.0 / H**0.5 for _ in range(L)]
    bias = [torch.randn(E, generator=g) * skew for _ in range(L)]
    rows_ids, rows_probs, rows_hidden = [], [], []
    seq_id, pos, phase, token_ids = [], [], [], []
    for s in range(sequences):
        n_rows = prompt_len + new_tokens - 1
        h0 = torch.randn(H, generator=g)
        for t in range(n_rows):
            h0 = (1 - token_drift) ** 0.5 * h0 + token_drift**0.5 * torch.randn(H, generator=g)
            h = h0.clone()
            ids_l, probs_l, hid_l = [], [], []
            for l in range(L):
                x = h / h.norm() * H**0.5
                p, ids, _ = route((gates[l] @ x + bias[l])[None], top_k)
                p = p[0]
                ids_l.append(ids[0])
                probs_l.append(p.half())
                hid_l.append(x.half())
                h = (1 - layer_drift) ** 0.5 * h + layer_drift**0.5 * torch.randn(H, generator=g) * h.norm() / H**0.5
            rows_ids.append(torch.stack(ids_l))
            rows_probs.append(torch.stack(probs_l))
            rows_hidden.append(torch.stack(hid_l))
            seq_id.append(s)
            pos.append(t)
            phase.append(PREFILL if t < prompt_len else DECODE)
            token_ids.append(int(torch.randint(0, 32000, (1,), generator=g)))
    trace = Trace(
        topk_ids=torch.stack(rows_ids), probs=torch.stack(rows_probs),
        token_ids=torch.tensor(token_ids, dtype=torch.int32), seq_id=torch.tensor(seq_id, dtype=torch.int32),
        pos=torch.tensor(pos, dtype=torch.int32), phase=torch.tensor(phase, dtype=torch.int8),
        num_layers=L, num_experts=E, top_k=top_k, model=model, hidden=torch.stack(rows_hidden),
        metadata={"synthetic": "1", "seed": str(seed)}, source=f"<synthetic {model}>",
    )
    return trace, gates


ROUTER_KEY = "routers.{l}.weight"  # how save_gates names layer l's router weight [E, H] (no model's naming)


def save_gates(gates: list[torch.Tensor], path: str | Path) -> Path:
    """Write router weights [E, H], one per layer, to a safetensors file under ``routers.{l}.weight``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({ROUTER_KEY.format(l=l): w.float().contiguous() for l, w in enumerate(gates)}, str(path))
    return path


def gate_modules(gates: list[torch.Tensor]) -> list[torch.nn.Linear]:
    """Router weights [E, H] -> bias-free ``nn.Linear`` routers (x [T, H] -> logits [T, E])."""
    out = []
    for w in gates:
        m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            m.weight.copy_(w)
        out.append(m.requires_grad_(False))
    return out
