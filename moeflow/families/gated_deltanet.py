"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE) and the norms these models use.

Per value head the layer keeps a state ``S [k_dim, v_dim]`` and, per token ``t`` (keys and queries
L2-normalised, queries scaled by ``k_dim ** -0.5``, ``a_t = exp(g_t)``)::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T        o_t = S_t^T q_t

``g_t = -exp(A_log) * softplus(a_proj + dt_bias)`` (the decay, in log space) and ``beta_t = sigmoid(b_proj)``
(the write strength). :func:`recurrent_gated_delta_rule` runs it token by token (decode);
:func:`chunk_gated_delta_rule` runs ``chunk`` tokens at a time as a few matmuls (prefill): within a chunk,
with ``G_t = exp(sum_{s<=t} g_s)`` from the chunk's start and the state ``S0`` it starts from,

    u = (I + A)^-1 (beta v - beta G k S0),   A_ij = beta_i (G_i / G_j) k_i.k_j  (j < i)
    o_t = G_t S0^T q_t + sum_{i<=t} (G_t / G_i) (q_t.k_i) u_i,   S_C = G_C S0 + sum_i (G_C / G_i) k_i u_i^T

(the ``u_i`` are the values each token actually writes). Both take the tokens of a pass with a mask: a padding
token gets ``g = 0`` and ``beta = 0``, so it leaves the state exactly as it was (left padding of a batch, the
right padding of a server's prefill chunk, a finished row in a decode step).

Before the rule, q/k/v go through a causal depthwise conv1d (kernel ``K``, SiLU) whose last ``K - 1`` inputs are
the conv state; after it, a gated RMSNorm (``norm(o) * silu(z)``) and ``out_proj``. The layer reads and writes
both states through the cache (:mod:`moeflow.engine.linear_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.families.layers import LinearFactory
from moeflow.kernels.dispatch import BACKENDS, uses_triton

CHUNK = 64  # tokens per chunk of the prefill form (as transformers' and FLA's)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored zero-centred: ``norm(x) * (1 + w)``, computed in fp32 and cast back after the
    scale (Qwen3-Next's and Qwen3.5's layer norms, QK-norms and final norm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] in the dtype of x."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w * norm(x) * silu(z)`` over each head's values: normalised in fp32, scaled in the input dtype, gated in
    fp32 (the DeltaNet's output norm; its weight is stored as is, not zero-centred)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., D] -> [..., D] in the dtype of x."""
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


# ------------------------------------------------------------------ the gated delta rule (fp32)
def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dimension (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q/k [B, H, T, dk] (normalised and scaled), v [B, H, T, dv], g/beta [B, H, T],
    state [B, H, dk, dv], all fp32 -> (o [B, H, T, dv], the state after the last token)."""
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outs, dim=2), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as :func:`recurrent_gated_delta_rule` (shapes alike), ``chunk`` tokens per step (see the
    module docstring). The tail is padded with g = beta = 0 tokens, which change nothing."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk) for x in (g, beta))
    cum = g.cumsum(-1)  # log G_t within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay from token j to token i (i >= j), zero above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    system = kk.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)  # I + A, unit lower triangular
    rhs = torch.cat((v * beta[..., None], k * (beta * cum.exp())[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_own, u_state = solved.split((dv, dk), dim=-1)  # u = u_own - u_state @ S0
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for c in range(n):
        u = u_own[:, :, c] - u_state[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + qk[:, :, c] @ u)
        state = state * end_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :t]
    return out, state


# ------------------------------------------------------------------ the layer
@dataclass(frozen=True)
class DeltaNetShape:
    """The sizes of one Gated DeltaNet layer (config.json's ``linear_*`` fields)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba (head-grouped) vs Qwen3.5's separate ones
    rms_norm_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of its state): q, k and v."""
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; parameters named as the checkpoints name them. ``state_idx``: its index among
    the model's linear-attention layers (where the cache keeps its states)."""

    def __init__(self, shape: DeltaNetShape, state_idx: int, linear_factory: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.shape, self.state_idx = shape, state_idx
        s, h = shape, shape.hidden_size
        if s.fused_projections:
            self.in_proj_qkvz = linear_factory("in_proj_qkvz", h, 2 * s.key_dim + 2 * s.value_dim)
            self.in_proj_ba = linear_factory("in_proj_ba", h, 2 * s.num_v_heads)
        else:
            self.in_proj_qkv = linear_factory("in_proj_qkv", h, s.conv_dim)
            self.in_proj_z = linear_factory("in_proj_z", h, s.value_dim)
            # one output per head: never quantized
            self.in_proj_b = nn.Linear(h, s.num_v_heads, bias=False, dtype=dtype)
            self.in_proj_a = nn.Linear(h, s.num_v_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(s.v_head_dim, s.rms_norm_eps, dtype)
        self.out_proj = linear_factory("out_proj", s.value_dim, h)
        self.kernels_backend = "auto"

    def use_kernels(self, backend: str) -> None:
        """"torch": the fp32 reference above; "triton": :mod:`moeflow.kernels.deltanet.kernels` (the decode conv,
        and for any T the fused recurrence; on a CPU under ``TRITON_INTERPRET=1``); "auto" (the default): Triton
        when the input is on CUDA."""
        if backend not in BACKENDS:
            raise ValueError(f"GatedDeltaNet kernels {backend!r}: expected 'torch', 'triton' or 'auto'")
        self.kernels_backend = backend

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, H] -> (qkv [B, T, conv_dim] (q, k, v heads in order), z [B, T, Hv, dv], b, a [B, T, Hv])."""
        s = self.shape
        bsz, t, _ = x.shape
        if not s.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(bsz, t, s.num_v_heads, s.v_head_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        # Qwen3-Next stores its projections grouped by key head: [q, k, r value heads, r z heads] per key head
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(bsz, t, s.num_k_heads, 2 * s.k_head_dim + 2 * r * s.v_head_dim)
        q, k, v, z = qkvz.split((s.k_head_dim, s.k_head_dim, r * s.v_head_dim, r * s.v_head_dim), dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, t, s.num_k_heads, 2 * r).split((r, r), dim=-1)
        qkv = torch.cat((q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)), dim=-1)
        return (qkv, z.reshape(bsz, t, s.num_v_heads, s.v_head_dim), b.reshape(bsz, t, -1),
                a.reshape(bsz, t, -1))

    def conv(self, qkv: torch.Tensor, conv_state: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU: qkv [B, T, C], conv_state [B, K-1, C] (the inputs before the pass), mask
        bool [B, T] -> (out [B, T, C], the new state: the K-1 inputs up to each row's last real token)."""
        t, keep = qkv.shape[1], self.shape.conv_kernel - 1
        window = torch.cat((conv_state.to(qkv.dtype), qkv), dim=1)  # [B, K-1+T, C]
        w = self.conv1d.weight
        out = F.silu(F.conv1d(window.transpose(1, 2).to(w.dtype), w, groups=w.shape[0])).transpose(1, 2)
        # a row's state ends at its last real token (none real: the old state), found without a host read
        steps = torch.arange(1, t + 1, device=mask.device)
        end = (mask * steps).amax(dim=1)  # [B]
        index = (end[:, None] + torch.arange(keep, device=mask.device))[..., None].expand(-1, -1, window.shape[-1])
        return out.to(qkv.dtype), window.gather(1, index)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; ``cache.linear_state(state_idx)``: (conv [B, K-1, C], recurrent fp32
        [B, Hv, dk, dv], mask bool [B, T] of the pass's real tokens); the new states go back through
        ``cache.write_linear_state``."""
        s = self.shape
        bsz, t, _ = x.shape
        if not hasattr(cache, "linear_state"):
            raise TypeError(f"{type(cache).__name__} keeps no linear-attention state: a Gated DeltaNet layer needs the "
                            "cache its family's kv_cache_spec() asks for (moeflow.engine.linear_state)")
        conv_state, recurrent, mask = cache.linear_state(self.state_idx)
        x = x * mask[..., None].to(x.dtype)  # padding tokens feed zeros into the conv, as transformers does
        qkv, z, b, a = self.project(x)
        if uses_triton(self.kernels_backend, x.device):
            from moeflow.kernels import deltanet

            if t == 1:  # the conv kernel shifts the conv state in place
                qkv = deltanet.conv_decode(qkv, conv_state, self.conv1d.weight, mask)
            else:
                qkv, conv_state = self.conv(qkv, conv_state, mask)
            # one launch for any T: gates, L2 norms and the recurrence fused, the state advanced in place
            out = deltanet.recurrent(qkv, a, b, self.A_log, self.dt_bias, mask, recurrent, s.num_k_heads,
                                     s.k_head_dim, x.dtype)
        else:
            qkv, conv_state = self.conv(qkv, conv_state, mask)
            rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
            out, recurrent = rule(*self.rule_inputs(qkv, a, b, mask), recurrent)
            out = out.transpose(1, 2).to(x.dtype)
        cache.write_linear_state(self.state_idx, conv_state, recurrent)  # in place already: copy_ returns at once
        out = self.norm(out, z)  # [B, T, Hv, dv]
        return self.out_proj(out.reshape(bsz, t, s.value_dim))

    def rule_inputs(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """The delta rule's fp32 inputs from the conv output qkv [B, T, conv_dim], a/b [B, T, Hv] and the mask
        [B, T]: q/k [B, Hv, T, dk] (L2-normalised, q scaled; key heads repeated), v [B, Hv, T, dv], g/beta
        [B, Hv, T] (0 on padding)."""
        s = self.shape
        bsz, t, _ = qkv.shape
        q, k, v = qkv.split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        r = s.num_v_heads // s.num_k_heads
        q, k = (y.reshape(bsz, t, s.num_k_heads, s.k_head_dim).float() for y in (q, k))
        if r > 1:  # each key head serves r consecutive value heads (a view and a copy: no host read)
            q, k = (y[:, :, :, None].expand(-1, -1, -1, r, -1).reshape(bsz, t, s.num_v_heads, s.k_head_dim)
                    for y in (q, k))
        q = l2_normalize(q).transpose(1, 2) * s.k_head_dim ** -0.5
        k = l2_normalize(k).transpose(1, 2)
        v = v.reshape(bsz, t, s.num_v_heads, s.v_head_dim).float().transpose(1, 2)
        real = mask.float()
        beta = (b.sigmoid().float() * real[..., None]).transpose(1, 2)  # [B, Hv, T]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()) * real[..., None]).transpose(1, 2)
        return q, k, v, g, beta
