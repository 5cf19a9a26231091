"""Synthetic routing traces of any model shape (e.g. Mixtral-8x7B's) with their routers.

When no real trace of a model exists (no Mixtral-8x7B run fits this project's machines), the simulator
can run on a trace made here. It is NOT real routing; it imitates three properties real MoE routing has
and that offloading policies exploit:

* skew: some experts of a layer are chosen more often (a per-layer logit bias);
* temporal locality: consecutive tokens have related hidden states (so related routing);
* a residual stream: layer l+1's input is layer l's plus a perturbation, so layer l+1's router applied to
  layer l's input (mixtral-offloading's speculation) is a good but imperfect guess.

Routing is the router's softmax top-k on the recorded hidden state, exactly as the model computes it, so
the routers written next to the trace (``save_gates``) make speculation policies simulable.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.trace import DECODE, PREFILL, Trace


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
                p = torch.softmax(gates[l] @ x + bias[l], dim=-1)
                ids_l.append(torch.topk(p, top_k).indices.to(torch.int32))
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


def save_gates(gates: list[torch.Tensor], path: str | Path) -> Path:
    """Write router weights under the checkpoint names ``model.layers.{l}.block_sparse_moe.gate.weight``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"model.layers.{l}.block_sparse_moe.gate.weight": w.float().contiguous() for l, w in enumerate(gates)},
              str(path))
    return path


def gate_modules(gates: list[torch.Tensor]) -> list[torch.nn.Linear]:
    out = []
    for w in gates:
        m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            m.weight.copy_(w)
        out.append(m.requires_grad_(False))
    return out
