"""Large linear layers on the CPU with quantized weights (``lm_head``, embeddings, attention projections).

Two formats, both through torch's own CPU kernels (no extension to build):

* ``bits=8``: symmetric int8 per output channel, ``W[n, k] = q[n, k] * s[n]``, through
  ``torch._weight_int8pack_mm``; 1 byte per weight (half of bf16); the weight error is at most s/2,
  ~0.2% of the channel's largest weight. The int8 rows double as an embedding table (:meth:`embedding`).
* ``bits=4``: asymmetric int4 per group of ``group_size`` input features (round-to-nearest with an integer
  zero point, exactly AWQ's format, so published AWQ projections load the same way: :func:`awq_linear_cpu`),
  through ``_weight_int4pack_mm_for_cpu`` (see :mod:`moeflow.kernels.cpu.int4`); ~0.53 bytes per weight.

Where moeflow's own CPU kernels build (:mod:`moeflow.kernels.cpu.native`), both formats run those instead
(``native``): fp32 in and out, activations rounded to int8 per 32 features, int4 scales kept in fp32; 2-4x
faster than torch's kernels on AVX2. :func:`reference_linear` models whichever runs.

Numerics of torch's kernels: both take bf16 activations (their fp32 paths are many times slower) and return bf16, so
``forward`` rounds x to bf16 and its result to bf16 before casting back to x's dtype. Measured on the
embedded model's lm_head (tests/test_cpu_quant_linear.py; max over positions of the relative logit error):
int8 1.7% with every argmax kept, int4 g32 15.5% and int4 per-channel 22% with 2% of the argmaxes changed.
So int8 is the format for ``lm_head`` / embeddings; int4 suits projections whose error the model absorbs
(and AWQ checkpoints, whose calibrated int4 is what the model was evaluated with).
:func:`reference_linear` with :meth:`CpuQuantLinear.dequantized` / :func:`int4_dequantized` is the plain-torch
fp32 model of ``forward`` (same rounding points).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.int4 import COMPUTE_DTYPE, Int4Matrix, native_format_fits
from moeflow.kernels.cpu.matrix_reference import q4_reference
from moeflow.kernels.cpu.native import BLOCK, native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, q4_matmul, q4_nbytes
from moeflow.kernels.cpu.q8_matrix import Q8Matrix, q8_matmul
from moeflow.quant.awq import check_group_size, dequantize, quantize_rtn

INT8_MAX = 127


class StoredLinears(Protocol):
    """A checkpoint whose quantized linear layers the CPU path can take as stored (a GGUF file's Q4_0 / Q4_1 / Q4_K
    blocks: :class:`moeflow.engine.gguf_linears.GGUFStoredLinears`) instead of quantizing their dense values again."""

    def cpu_linear(self, module_name: str) -> CpuQuantLinear | None:
        """The layer for the decoder module ``module_name`` from its stored codes, or None (keep the dense path)."""

    def exact_linear(self, module_name: str) -> nn.Module | None:
        """A layer computed on ``module_name``'s stored blocks as they are (a GGUF file's Q8_0: ``GGUFLinear``,
        with ``set_bias``), for projections outside the fused CPU step, or None (quantize the dense values)."""

    def lm_head(self) -> nn.Module | None:
        """The lm_head on its stored blocks where that reads fewer bytes than int8 and a CPU kernel computes it,
        else None (the int8 head)."""


class CpuQuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` for an ``nn.Linear`` weight ``W [out, in]`` held in int8 or int4 (bias: ``set_bias``).

    A module, so it can take an ``nn.Linear``'s place (``model.lm_head = quantize_linear_cpu(...)``). Buffers:
    int8: ``int8_weight`` int8 [out, in] and ``int8_scales`` [out] (bf16 values). For moeflow's kernel they are
    held in fp32 with the rows grouped as :class:`Q8Matrix` lays them out, once at construction (``int8``:
    already grouped; ``int8_weight``: plain rows). int4 for torch's kernel: ``packed`` uint8 [out, in/2] and
    ``scales_zeros`` bf16 [in/g, out, 2] (see :class:`Int4Matrix`); int4 for moeflow's: ``packed``, ``scales``,
    ``mins`` (see :class:`Q4Matrix`).
    """

    def __init__(self, bits: int, in_features: int, out_features: int, *, int8_weight: torch.Tensor | None = None,
                 int8_scales: torch.Tensor | None = None, int4: Int4Matrix | Q4Matrix | None = None,
                 int8: Q8Matrix | None = None) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features = bits, in_features, out_features
        self.group_size = int4.group_size if int4 is not None else in_features
        if bits == 8:
            self.native = int8 is not None or (native_available() and in_features % BLOCK == 0)
            if self.native and int8 is None:
                int8 = Q8Matrix.from_rows(int8_weight, int8_scales)  # the kernel's row groups, once at load
            self.register_buffer("int8_weight", int8.weight if self.native else int8_weight)
            self.register_buffer("int8_scales", int8.scales if self.native else int8_scales)
        else:
            self.native = isinstance(int4, Q4Matrix)
            self.register_buffer("packed", int4.packed)
            if self.native:
                self.register_buffer("scales", int4.scales)
                self.register_buffer("mins", int4.mins)
            else:
                self.register_buffer("scales_zeros", int4.scales_zeros)
        self.register_buffer("bias", None)

    def set_bias(self, bias: torch.Tensor) -> None:
        """Add ``bias [out]`` to every output (a biased projection's bias, kept unquantized in fp32)."""
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, this layer has {self.out_features} outputs")
        self.bias = bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (any float dtype) -> [..., out] in x's dtype (bf16 compute, see the module docstring)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features in its last dimension, this layer takes "
                             f"{self.in_features}")
        if self.native:
            if self.bits == 8:
                y = q8_matmul(x, self.int8_weight, self.int8_scales)
            else:
                y = q4_matmul(x, self.packed, self.scales, self.mins, self.group_size)
            if self.bias is not None:
                y += self.bias
            return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], self.out_features)
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.bits == 8:
            y = torch._weight_int8pack_mm(flat, self.int8_weight, self.int8_scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)
        y = y.to(x.dtype) if self.bias is None else (y.float() + self.bias).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}" + \
            (f", group_size={self.group_size}" if self.bits == 4 else "")

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W as an embedding table: ids [...] -> fp32 [..., in] (int8 only: int4 rows are packed)."""
        if self.bits != 8:
            raise ValueError("embedding lookup needs bits=8 (torch's int4 CPU layout packs rows together)")
        rows = self.q8.rows(ids) if self.native else self.int8_weight[ids]
        return rows.float() * self.int8_scales[ids].float()[..., None]

    def dequantized(self) -> torch.Tensor:
        """The int8 weight this layer multiplies by, fp32 [out, in] (int4: see :func:`int4_dequantized`)."""
        if self.bits != 8:
            raise ValueError("dequantized() reads int8 weights; for int4 use int4_dequantized(AWQ tensors)")
        if self.native:
            return self.q8.dequantized()
        return self.int8_weight.float() * self.int8_scales.float()[:, None]

    @property
    def q8(self) -> Q8Matrix:
        """The int8 weight in moeflow's kernel format (a view of this layer's buffers; native int8 layers only)."""
        if self.bits != 8 or not self.native:
            raise ValueError("q8 is the native int8 layer's matrix; this layer runs torch's kernels or int4")
        return Q8Matrix(self.int8_weight, self.int8_scales)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call (weights and scales)."""
        if self.bits == 8:
            return self.int8_weight.numel() + self.int8_scales.numel() * self.int8_scales.element_size()
        if self.native:
            return q4_nbytes(self.packed, self.scales, self.mins)
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


class SplitLinear(nn.Module):
    """``y = cat([p(x) for p in parts], -1)``: two native layers whose rows one fused matrix cannot hold, being of
    different forms (a GGUF file's Q4_0 q beside its Q8_0 k and v): the CPU step's q/k/v projection
    (:func:`~moeflow.kernels.cpu.step.attention_block` runs both parts in one call). Each output row's numbers are
    its part's (a row's result does not depend on the other rows)."""

    def __init__(self, parts: tuple[CpuQuantLinear, CpuQuantLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"SplitLinear: parts of {[p.in_features for p in parts]} input features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype: the parts' outputs side by side."""
        return torch.cat([p(x) for p in self.parts], dim=-1)


def int4_dequantized(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """The weight an int4 :class:`CpuQuantLinear` built from these AWQ tensors multiplies by, fp32 [out, in]
    (moeflow's kernel: fp32 scales; torch's: scales rounded to bf16, as its int4 format stores them)."""
    if native_format_fits(group_size):
        with hugepages.plain():  # (a temporary form)
            return Q4Matrix.from_awq(qweight, qzeros, scales, group_size).dequantized()
    s = scales.float().to(COMPUTE_DTYPE).float()
    return dequantize(qweight, qzeros, s, group_size).T.contiguous()


def reference_linear(x: torch.Tensor, weight: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """Plain-torch fp32 model of :meth:`CpuQuantLinear.forward` for a dequantized weight [out, in], returned in
    x's dtype. ``native`` (default: whether moeflow's kernels run here): x [..., in] rounded to int8 per 32
    features, fp32 result; otherwise x rounded to bf16 and the result too (torch's kernels)."""
    if native if native is not None else native_available():
        return q4_reference(x, weight).to(x.dtype)
    y = x.to(COMPUTE_DTYPE).float() @ weight.float().T
    return y.to(COMPUTE_DTYPE).to(x.dtype)


def quantize_linear_cpu(weight: torch.Tensor, bits: int = 8, group_size: int = 128) -> CpuQuantLinear:
    """Quantize an ``nn.Linear`` weight ``[out, in]`` (any float dtype) at load time for the CPU kernels.

    bits=8: per output channel (group_size is ignored); bits=4: per ``group_size`` input features.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [out, in] matrix, got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if bits == 8:  # per row, in blocks of rows: the fp32 temporaries stay in cache (a vocabulary-sized lm_head)
        src = weight.detach().cpu()
        from moeflow.kernels.cpu.native import library
        from moeflow.kernels.repack import quantize_rows_int8_native

        fast = quantize_rows_int8_native(library(), src) if src.dtype == torch.float32 else None  # same bits, in C
        if fast is not None:
            return CpuQuantLinear(8, in_features, out_features, int8_weight=fast[0], int8_scales=fast[1])
        scales = torch.empty(out_features, dtype=COMPUTE_DTYPE)
        q = torch.empty((out_features, in_features), dtype=torch.int8)
        step = max(1, 2**20 // max(in_features, 1))
        for a in range(0, out_features, step):
            w = src[a:a + step].float()
            s = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-8).to(COMPUTE_DTYPE)
            scales[a:a + step] = s
            q[a:a + step] = torch.round(w / s.float()[:, None]).clamp(-INT8_MAX, INT8_MAX)
        return CpuQuantLinear(8, in_features, out_features, int8_weight=q, int8_scales=scales)
    w = weight.detach().cpu().float()
    if bits == 4:
        check_group_size(group_size, in_features)
        t = quantize_rtn(w, group_size)
        return awq_linear_cpu(t.qweight, t.qzeros, t.scales, group_size)
    raise ValueError(f"bits={bits}: expected 8 or 4")


def awq_linear_cpu(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> CpuQuantLinear:
    """An AWQ (GEMM layout) linear as published: qweight int32 [in, out/8], qzeros int32 [in/g, out/8],
    scales [in/g, out] -> torch's int4 CPU format."""
    in_features, out_features = qweight.shape[0], scales.shape[1]
    if out_features % 16 or in_features % 32:
        raise ValueError(f"qweight [{in_features}, {out_features // 8}]: the int4 CPU kernel needs out_features "
                         f"% 16 == 0 and in_features % 32 == 0")
    make = Q4Matrix.from_awq if native_format_fits(group_size) else Int4Matrix.from_awq
    int4 = make(qweight, qzeros, scales, group_size)
    return CpuQuantLinear(4, in_features, out_features, int4=int4)
