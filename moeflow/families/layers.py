"""Building blocks shared by the families' decoders: RMSNorm, rotary embeddings, AWQ linear, GQA attention,
and the dense gated MLP (dense layers between MoE layers, shared experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moeflow import kernels
from moeflow.compile_boundary import eager_host_step
from moeflow.kernels.cpu.step import NATIVE_ATTENTION_TOKENS, QKNorm, attention_step, rmsnorm
from moeflow.kernels.experts.checks import check_pool_weights


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.native = False  # one call into moeflow's CPU library (fp32 on the CPU; set by engine.cpu_step)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., H]: normalise in fp32, then scale in the input dtype (as transformers does).

        With ``residual`` [..., H]: normalise ``x + residual`` instead and return ``(x + residual, normed)``
        (the residual stream and the next block's input, one call on the native path)."""
        if self.native and x.dtype == torch.float32 and x.is_contiguous() and \
                (residual is None or residual.is_contiguous()):
            normed, total = rmsnorm(x, self.weight, self.eps, residual)
            return normed if residual is None else (total, normed)
        if residual is not None:
            x = x + residual
            return x, self(x)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


ONE_POSITION_MEMO = 8192  # one-position (cos, sin) pairs a RotaryEmbedding keeps on the CPU (~1 KB each at D 128)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # a CPU decode step's one position -> its (cos, sin), computed once by the ops below (the same bits):
        # the step then costs a dict look-up instead of five small torch ops
        self._one: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin) [B, T, head_dim], computed in fp32 (for one position on the CPU,
        computed once and kept: do not write into them)."""
        if position_ids.numel() == 1 and eager_host_step(position_ids):
            key = (int(position_ids), position_ids.dim(), dtype)
            hit = self._one.get(key)
            if hit is None:
                hit = self._compute(position_ids, dtype)
                if len(self._one) < ONE_POSITION_MEMO:
                    self._one[key] = hit
            return hit
        return self._compute(position_ids, dtype)

    def _compute(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary (halves layout): x [B, heads, T, D]; cos/sin [B, T, r] with r <= D. Partial rotary (r < D, GLM-4.5,
    MiniMax-M2) turns the first r values of each head and keeps the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos[:, None] + rotate_half(x) * sin[:, None]
    turned = x[..., :r]
    return torch.cat((turned * cos[:, None] + rotate_half(turned) * sin[:, None], x[..., r:]), dim=-1)


class Fp32Linear(nn.Linear):
    """A bias-free linear layer kept in fp32 whatever the model's dtype (the loader keeps its dtype: DSA's
    indexer weights)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=torch.float32)


class AWQLinear(nn.Module):
    """A linear layer holding AWQ GEMM-layout 4-bit weights (and an optional bias); computes ``x @ W (+ b)``."""

    def __init__(self, in_features: int, out_features: int, group_size: int, scales_dtype: torch.dtype,
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        g = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(g, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(g, out_features, dtype=scales_dtype))
        # quantized checkpoints keep a projection's bias (Qwen2's q/k/v) unquantized, in the scales' dtype
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=scales_dtype), requires_grad=False) if bias else None
        self.kernels_backend = "torch"
        self.packed = False  # weights in the expert kernels' layout (use_kernels), not AWQ's as published

    def use_kernels(self, backend: str) -> None:
        """Pick the kernels once the weights are loaded. The Triton path repacks them here, once, into the expert
        kernels' panel-major layout (``kernels.pack_awq_linear``: exact, the same bytes) instead of per call."""
        self.kernels_backend = backend
        if not self.packed and kernels.uses_triton(backend, self.qweight.device):
            for name, tensor in kernels.pack_awq_linear(self.qweight, self.qzeros, self.scales).items():
                setattr(self, name, tensor)  # registered buffers: assignment keeps them buffers
            # checked here, once: forward skips the weight checks on every call (weights_checked)
            check_pool_weights(self.qweight[None], self.qzeros[None], self.scales[None], self.group_size,
                               self.in_features, self.out_features, "AWQLinear ", 1)
            self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: fp32 accumulation, output in the dtype of x."""
        flat = x.reshape(-1, self.in_features)
        # packed: the weights were checked when packed and never change (no per-call weight checks)
        y = kernels.awq_linear(flat, self.qweight, self.qzeros, self.scales, self.group_size,
                               backend=self.kernels_backend, packed=self.packed, weights_checked=self.packed)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


QKV = ("q_proj", "k_proj", "v_proj")


def fuse_awq_linears(linears: list[nn.Module]) -> AWQLinear | None:
    """One packed :class:`AWQLinear` whose output is ``linears``' outputs concatenated (q/k/v: one GEMM launch,
    its split K reduced inside it, instead of three), or None when they cannot share one matrix (not all AWQ linears
    packed for the Triton kernels, different input sizes, groups, dtypes or devices, biased and unbiased mixed).

    Exact per output column: concatenating along N keeps each column's weights, zeros, scales and bias, so a
    column is computed as before whenever the launch config (BLOCK_K, SPLIT_K) is the one the unfused linear got
    (``benchmarks/count_eager_launches.py`` reports it for the families' shapes). Each linear's tensors become
    views of the fused ones (the memory is held once): ``qweight [K/P, N, P/8]`` rows of every panel,
    ``qzeros [K/g, N/8]`` and ``scales [K/g, N]`` columns (strided views the packed kernel reads by stride),
    bias entries."""
    if not linears or not all(type(p) is AWQLinear and p.packed for p in linears):
        return None
    first = linears[0]
    if len({(p.in_features, p.group_size, p.scales.dtype, p.scales.device, p.bias is None, p.kernels_backend)
            for p in linears}) != 1 or any(p.out_features % 8 for p in linears):
        return None
    with torch.device("meta"):  # every tensor is replaced below: allocate none here
        fused = AWQLinear(first.in_features, sum(p.out_features for p in linears), first.group_size,
                          first.scales.dtype, bias=first.bias is not None)
    fused.qweight = torch.cat([p.qweight for p in linears], dim=1)
    fused.qzeros = torch.cat([p.qzeros for p in linears], dim=1)
    fused.scales = torch.cat([p.scales for p in linears], dim=1)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in linears]), requires_grad=False)
    fused.kernels_backend, fused.packed = first.kernels_backend, True
    start = 0
    for p in linears:
        end = start + p.out_features
        p.qweight, p.qzeros, p.scales = (fused.qweight[:, start:end], fused.qzeros[:, start // 8:end // 8],
                                         fused.scales[:, start:end])
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias.detach()[start:end], requires_grad=False)
        start = end
    return fused


def fuse_qkv_projections(decoder: nn.Module) -> int:
    """Give every attention module of ``decoder`` with a ``qkv_proj`` slot one fused q/k/v linear when its
    projections are packed AWQ linears (the Triton path: :func:`fuse_awq_linears`); done once at load. Returns
    how many were fused."""
    count = 0
    for module in list(decoder.modules()):
        if not hasattr(module, "qkv_proj") or module.qkv_proj is not None:
            continue
        fused = fuse_awq_linears([getattr(module, name, None) for name in QKV])
        if fused is not None:
            module.qkv_proj, module.fused_qkv = fused, True
            count += 1
    return count


def project_qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, H] -> (q, k, v) [B, T, heads * D] / [B, T, kv_heads * D]: one launch through ``attn.qkv_proj``
    when fused (views of its output), else ``q_proj``, ``k_proj``, ``v_proj``."""
    if attn.fused_qkv:
        return attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1)
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def _sdpa_has_gqa() -> bool:
    """torch >= 2.5 takes ``enable_gqa`` in scaled_dot_product_attention."""
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


_SDPA_GQA = _sdpa_has_gqa()


def attend_in_place(cache: Any, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache_position: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor | None:
    """The cache's own decode attention (``attend``: the server's decode view, a kernel reading the cache rows in
    place instead of gathering them) -> out [B, heads, 1, D]; None when the cache has none or does not take
    this call: the caller then writes with ``cache.update`` and attends itself, under its mask."""
    attend = getattr(cache, "attend", None)
    return attend(layer, q, k, v, cache_position, sliding_window, sinks, scale) if attend is not None else None

# (name, fan_in, fan_out) -> a linear module; called with ``bias=True`` as a keyword for a biased projection
LinearFactory = Callable[..., nn.Module]


def make_linear(factory: LinearFactory, name: str, fan_in: int, fan_out: int, bias: bool = False) -> nn.Module:
    """``factory``'s linear module, passing ``bias=True`` only when asked (bias-free factories stay valid)."""
    return factory(name, fan_in, fan_out, bias=True) if bias else factory(name, fan_in, fan_out)


class GatedMLP(nn.Module):
    """A dense SwiGLU MLP ``down(silu(gate(x)) * up(x))``: Qwen's dense layers and shared experts.

    ``output_gate``: a ``[1, H]`` linear whose sigmoid scales the output (Qwen2-MoE's ``shared_expert_gate``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, linear_factory: LinearFactory,
                 dtype: torch.dtype, output_gate: bool = False):
        super().__init__()
        self.gate_proj = linear_factory("gate_proj", hidden_size, intermediate_size)
        self.up_proj = linear_factory("up_proj", hidden_size, intermediate_size)
        self.down_proj = linear_factory("down_proj", intermediate_size, hidden_size)
        # a one-output linear is never quantized: always a plain linear layer
        self.output_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype) if output_gate else None
        # the whole MLP as one native call (the CPU engine's, engine.cpu_step); None or its None: the modules
        self.native_step: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        if self.native_step is not None:
            y = self.native_step(x)
            if y is not None:
                return y
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.output_gate is not None:
            y = torch.sigmoid(self.output_gate(x)) * y
        return y


class Attention(nn.Module):
    """Rotary grouped-query attention over a static KV cache (Llama/Mixtral layout: q/k/v/o projections).

    Options some families need (defaults: Mixtral's plain attention): ``qkv_bias`` / ``o_bias`` (biased
    projections: Qwen2, OLMoE's ``attention_bias``), ``qk_norm`` (RMSNorm of queries and keys before the
    rotary: ``"head"`` over each head's ``head_dim`` as Qwen3, ``"projection"`` over the whole projection
    as OLMoE; ``"head_after_rotary"``: per head, after the rotary, as Hunyuan-A13B), ``clip_qkv`` (clamp q, k and
    v to +-clip_qkv, OLMoE), ``rotary_dim`` (partial rotary: the decoder's cos/sin turn only the first
    ``rotary_dim`` values of each head, MiniMax-M2; None: all of them).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 linear_factory: LinearFactory, sliding_window: int | None = None, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: str | None = None, norm_eps: float = 1e-6,
                 clip_qkv: float | None = None, rotary_dim: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = rotary_dim or head_dim  # the CPU library's fused step turns whole heads only (cpu_step)
        h = hidden_size
        self.q_proj = make_linear(linear_factory, "q_proj", h, self.n_heads * self.head_dim, qkv_bias)
        self.k_proj = make_linear(linear_factory, "k_proj", h, self.n_kv * self.head_dim, qkv_bias)
        self.v_proj = make_linear(linear_factory, "v_proj", h, self.n_kv * self.head_dim, qkv_bias)
        self.o_proj = make_linear(linear_factory, "o_proj", self.n_heads * self.head_dim, h, o_bias)
        self.sliding_window = sliding_window
        if qk_norm not in (None, "head", "projection", "head_after_rotary"):
            raise ValueError(f"qk_norm={qk_norm!r}: expected None, 'head', 'projection' or 'head_after_rotary'")
        self.qk_norm, self.clip_qkv = qk_norm, clip_qkv
        # q/k/v as one matrix (its rows are q_proj's, k_proj's, v_proj's) with ``fused_qkv``: set at load on the
        # CPU int4 path (engine.cpu_step) and the Triton path (fuse_qkv_projections). ``fused_step`` (CPU only):
        # rotary + cache write + attention as one call into moeflow's CPU library (fp32, a static cache)
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (self.n_heads * head_dim, self.n_kv * head_dim, self.n_kv * head_dim)
        self.fused_qkv = False
        self.fused_step = False
        if qk_norm is not None:
            per_head = qk_norm != "projection"
            self.q_norm = RMSNorm(head_dim if per_head else self.n_heads * head_dim, norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim if per_head else self.n_kv * head_dim, norm_eps, dtype)

    def native_qk_norm(self) -> QKNorm | None:
        """The QK-norm as the CPU library's fused attention computes it (engine.cpu_step sets ``fused_step`` only
        where it can: "head" or "projection", before the rotary); None without one."""
        if self.qk_norm is None:
            return None
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.qk_norm != "projection")

    def _normalize_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D]: QK-norm, then the clamp (the order OLMoE uses)."""
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "projection":  # normalise the concatenated heads of each token
            q, k = (_per_token(norm, t) for norm, t in ((self.q_norm, q), (self.k_norm, k)))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
        cache_position: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; cache: the engine's KV cache (``update(layer, k, v, cache_position)``);
        mask bool [B, 1, T, max_len]."""
        b, t, _ = x.shape
        if self.fused_step:
            qkv = self.qkv_proj(x)  # [B, T, (heads + 2 kv_heads) D]
            layer_kv = getattr(cache, "layer_kv", None)
            if layer_kv is not None and t <= NATIVE_ATTENTION_TOKENS and qkv.dtype == torch.float32 \
                    and mask.is_contiguous() and layer_kv[self.layer_idx][0].dtype == torch.float32:
                k_all, v_all = layer_kv[self.layer_idx]
                return self.o_proj(attention_step(qkv, self.n_heads, self.n_kv, cos, sin, k_all, v_all,
                                                  cache_position, mask, self.native_qk_norm()))
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = project_qkv(self, x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        late_norm = self.qk_norm == "head_after_rotary"
        if (self.qk_norm is not None and not late_norm) or self.clip_qkv is not None:
            q, k, v = self._normalize_qkv(q, k, v)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if late_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend_in_place(cache, self.layer_idx, q, k, v, cache_position, self.sliding_window)
        if out is not None:
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
        groups = self.n_heads // self.n_kv
        if groups > 1 and _SDPA_GQA:  # each kv head serves its query heads inside the kernel: no copy of the cache
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        else:
            if groups > 1:  # torch without enable_gqa: share the kv heads by copying them
                k_all = k_all.repeat_interleave(groups, dim=1)
                v_all = v_all.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class AttentionHalfStep(Protocol):
    """A pre-norm layer's attention half as one call (the engine's native CPU step, engine.cpu_step): the
    arguments of :meth:`PreNormLayer.attention_half` -> ``(x + attn, its norm)``, or None when it cannot take this
    step (the layer then runs its modules)."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                 cache_position: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class PreNormLayer(nn.Module):
    """A decoder layer of the pre-norm layout: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
    then a feed-forward half the subclass owns. Its attention half can be replaced by a faster step of the same
    result (:meth:`set_attention_step`): the declared seam the CPU engine uses."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm

    def __init__(self) -> None:
        super().__init__()
        self.attention_step: AttentionHalfStep | None = None

    def set_attention_step(self, step: AttentionHalfStep | None) -> None:
        """Use ``step`` for the attention half (None: the modules, one by one)."""
        self.attention_step = step

    def attention_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                       cache_position: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (x + attn, post_attention_layernorm(x + attn))."""
        fused = self.attention_step(x, cos, sin, cache, cache_position, mask) if self.attention_step else None
        if fused is not None:
            return fused
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_position, mask)
        return self.post_attention_layernorm(x, residual=attn)  # x + attn, and its norm (one call on the CPU)


def _per_token(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply ``norm`` over all heads of each token: x [B, heads, T, D] -> [B, heads, T, D]."""
    b, n, t, d = x.shape
    return norm(x.transpose(1, 2).reshape(b, t, n * d)).view(b, t, n, d).transpose(1, 2)
