"""MXFP4 experts (gpt-oss) computed on the CPU from the bytes the host store holds (``mxfp4.c``): the e2m1 codes and
e8m0 scales of an expert's region (:class:`~moeflow.kernels.formats.MXFP4Format`'s kernel layout: K panels, bits
permuted within each 32-bit word) times int8 activations, the way llama.cpp's CPU backend multiplies MXFP4 by
Q8_0 (a 16-entry table of doubled e2m1 values, integer dot products, the block factor ``2**(e - 127) / 2`` times
the activation's scale), with gpt-oss's epilogue (biases, clamped SwiGLU; gate rows then up rows as stored).

The CPU form (:class:`Mxfp4NativeExpert`) is views of a region: no converted copy (the torch int4 digit form of
:mod:`moeflow.kernels.cpu.mxfp4` took 2.35x the expert's bytes; it stays the path where the kernels do not build).

Numerics (:func:`mxfp4_native_reference` is the fp32 model): activations rounded to int8 per block of 32 (scale
max|x| / 127, round half to even), weights exact, each block's integer sums exact, fp32 across blocks; biases and
the activation in fp32; the intermediate activations quantized the same way before the down projection. The
AVX-512 VNNI, AVX2 and portable builds give the same bits, and a token's result does not depend on the batch
(``mxfp4.c``'s comment states the order of operations).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from moeflow.kernels.cpu.native import check_rc, declared_library
from moeflow.kernels.experts.biased import gate_activation
from moeflow.kernels.experts.mxfp4_reference import BLOCK, dequantize_mxfp4, from_kernel_layout, from_panels
from moeflow.kernels.formats.biased import BiasedExpertFormat

ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # mxfp4.c's MX_SILU, MX_SWIGLU
BIAS_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # MX_BIAS_*


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.mf_mxfp4_linear.argtypes = [p, i, i, i, p, p, i, p, i]
    lib.mf_mxfp4_expert.argtypes = [p, i, i, i, p, p, i, p, p, p, i, p, i, i, f, f, p, p, i, i]
    lib.mf_mxfp4_linear.restype = lib.mf_mxfp4_expert.restype = i


def _lib() -> ctypes.CDLL:
    return declared_library(_signatures, "the native MXFP4 expert cannot run")


@dataclass
class Mxfp4RegionMatrix:
    """One MXFP4 matrix ``W [N, K]`` in the region layout: ``blocks`` uint8 ``[K/P, N, P/32, 16]`` (kernel bit
    layout), ``scales`` uint8 ``[K/P, N, P/32]``; contiguous views (of a region, or owned)."""

    blocks: torch.Tensor
    scales: torch.Tensor
    name: str = "mxfp4"

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if (b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() != 4 or s.dim() != 3 or b.shape[3] != 16
                or tuple(b.shape[:3]) != tuple(s.shape) or b.shape[2] * BLOCK not in (32, 64)
                or not (b.is_contiguous() and s.is_contiguous()) or b.device.type != "cpu"):
            raise ValueError(f"MXFP4 {self.name}: expected contiguous CPU uint8 blocks [K/P, N, P/32, 16] and scales "
                             f"[K/P, N, P/32] with P 32 or 64, got {b.dtype} {tuple(b.shape)} / {s.dtype} "
                             f"{tuple(s.shape)}")

    @property
    def n(self) -> int:
        return self.blocks.shape[1]

    @property
    def k(self) -> int:
        return self.blocks.shape[0] * self.panel

    @property
    def panel(self) -> int:
        return self.blocks.shape[2] * BLOCK

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K], exactly the stored weights."""
        return dequantize_mxfp4(from_kernel_layout(from_panels(self.blocks)), from_panels(self.scales))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x @ W.T fp32 [M, N] (int8 activations, see the module doc)."""
        rows = x.reshape(-1, self.k).float().contiguous()
        y = torch.empty((rows.shape[0], self.n), dtype=torch.float32)
        check_rc(_lib().mf_mxfp4_linear(rows.data_ptr(), rows.shape[0], self.k, self.n, self.blocks.data_ptr(),
                                         self.scales.data_ptr(), self.panel, y.data_ptr(), torch.get_num_threads()),
                  f"mxfp4 {self.name} linear")
        return y

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()


@dataclass
class Mxfp4NativeExpert:
    """One gpt-oss expert computed by ``mxfp4.c`` from its region's bytes: ``w13`` ``[2I, H]`` (gate rows, then up),
    ``w2`` ``[H, I]``, biases ``b13`` ``[2I]`` and ``b2`` ``[H]`` (fp32, bf16 or fp16 views, or None)."""

    w13: Mxfp4RegionMatrix
    w2: Mxfp4RegionMatrix
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    fmt: BiasedExpertFormat  # bias, activation, swiglu_alpha, swiglu_limit

    def __post_init__(self) -> None:
        H, I = self.w2.n, self.w2.k  # noqa: E741
        if (self.w13.n, self.w13.k) != (2 * I, H):
            raise ValueError(f"MXFP4 expert: w13 is [{self.w13.n}, {self.w13.k}], w2 [{H}, {I}]: expected w13 "
                             f"[{2 * I}, {H}]")
        if (self.b13 is None) != (self.b2 is None):
            raise ValueError("MXFP4 expert: w13_bias and w2_bias come together")
        if self.b13 is not None:
            if (self.b13.dtype not in BIAS_KINDS or self.b2.dtype != self.b13.dtype or self.b13.shape != (2 * I,)
                    or self.b2.shape != (H,) or not (self.b13.is_contiguous() and self.b2.is_contiguous())):
                raise ValueError(f"MXFP4 expert: biases must be contiguous [{2 * I}] and [{H}] of one of "
                                 f"{list(BIAS_KINDS)}, got {self.b13.dtype} {tuple(self.b13.shape)} / "
                                 f"{self.b2.dtype} {tuple(self.b2.shape)}")
        if self.fmt.activation not in ACTIVATIONS:
            raise ValueError(f"MXFP4 expert: activation {self.fmt.activation!r} has no CPU kernel "
                             f"({', '.join(ACTIVATIONS)})")

    @classmethod
    def from_views(cls, views: dict[str, torch.Tensor], fmt: BiasedExpertFormat) -> Mxfp4NativeExpert:
        """views: one expert's region tensors as :class:`~moeflow.kernels.formats.MXFP4Format` names them."""
        bias = fmt.bias
        return cls(Mxfp4RegionMatrix(views["w13_blocks"], views["w13_scales"], "w13"),
                   Mxfp4RegionMatrix(views["w2_blocks"], views["w2_scales"], "w2"),
                   views["w13_bias"] if bias else None, views["w2_bias"] if bias else None, fmt)

    @property
    def hidden_size(self) -> int:
        return self.w2.n

    @property
    def intermediate_size(self) -> int:
        return self.w2.k

    def forward(self, rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [n, H] (any float dtype), routing weights [n] -> weighted output [n, H] in rows' dtype (fp32
        ``out`` [n, H] given: added into it and returned)."""
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        x = rows.reshape(-1, H)
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        w = weights.to(torch.float32).contiguous()
        acc = out is not None
        y = out if acc else torch.empty((x.shape[0], H), dtype=torch.float32)
        if acc and (y.dtype != torch.float32 or not y.is_contiguous() or tuple(y.shape) != (x.shape[0], H)):
            raise ValueError(f"Mxfp4NativeExpert.forward(out=...): expected contiguous fp32 {(x.shape[0], H)}")
        if x.shape[0]:
            b13, b2 = (None, None) if self.b13 is None else (self.b13.data_ptr(), self.b2.data_ptr())
            kind = 0 if self.b13 is None else BIAS_KINDS[self.b13.dtype]
            check_rc(_lib().mf_mxfp4_expert(
                x.data_ptr(), x.shape[0], H, I, self.w13.blocks.data_ptr(), self.w13.scales.data_ptr(),
                self.w13.panel, b13, self.w2.blocks.data_ptr(), self.w2.scales.data_ptr(), self.w2.panel, b2, kind,
                ACTIVATIONS[self.fmt.activation], self.fmt.swiglu_alpha, self.fmt.swiglu_limit, w.data_ptr(),
                y.data_ptr(), int(acc), torch.get_num_threads()), "mxfp4 expert")
        return y if acc else y.to(rows.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks and scales a call reads (the expert's MXFP4 bytes)."""
        return self.w13.nbytes + self.w2.nbytes



@dataclass(frozen=True)
class Mxfp4RegionLayout:
    """Where an expert's matrices and biases sit in its region of one format (byte offsets), taken once from a
    validated :class:`Mxfp4NativeExpert` (:func:`region_layout`): a slot's expert is then one kernel call on the
    slot's address, without building views per call (the decode step's per-expert Python cost)."""

    hidden: int
    inter: int
    p13: int
    p2: int
    offsets: tuple[int, int, int, int, int, int]  # w13 blocks, scales, bias; w2 blocks, scales, bias (-1: none)
    bias_kind: int
    activation: int
    alpha: float
    limit: float

    def forward_at(self, base: int, x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, H] (contiguous fp32, overwritten) = :meth:`Mxfp4NativeExpert.forward` of the expert whose
        region starts at address ``base`` (of a live contiguous buffer) on x [n, H] (contiguous fp32) with routing
        weights [n] (contiguous fp32): the same call, so the same bits."""
        n = x.shape[0]
        if not n:
            return
        b13, s13, c13, b2, s2, c2 = (base + o if o >= 0 else None for o in self.offsets)
        check_rc(_lib().mf_mxfp4_expert(
            x.data_ptr(), n, self.hidden, self.inter, b13, s13, self.p13, c13, b2, s2, self.p2, c2, self.bias_kind,
            self.activation, self.alpha, self.limit, weights.data_ptr(), out.data_ptr(), 0,
            torch.get_num_threads()), "mxfp4 expert")


_LAYOUTS: dict[BiasedExpertFormat, Mxfp4RegionLayout] = {}


def region_layout(fmt: BiasedExpertFormat, region: torch.Tensor, views: dict[str, torch.Tensor]
                  ) -> Mxfp4RegionLayout:
    """The :class:`Mxfp4RegionLayout` of ``fmt`` (cached per format), from one region ``uint8 [nbytes]`` and its
    typed ``views`` (validated by :class:`Mxfp4NativeExpert` the first time)."""
    layout = _LAYOUTS.get(fmt)
    if layout is None:
        e = Mxfp4NativeExpert.from_views(views, fmt)
        base = region.data_ptr()
        tensors = (e.w13.blocks, e.w13.scales, e.b13, e.w2.blocks, e.w2.scales, e.b2)
        offsets = tuple(-1 if t is None else t.data_ptr() - base for t in tensors)
        layout = _LAYOUTS[fmt] = Mxfp4RegionLayout(
            e.hidden_size, e.intermediate_size, e.w13.panel, e.w2.panel, offsets,
            0 if e.b13 is None else BIAS_KINDS[e.b13.dtype], ACTIVATIONS[fmt.activation], fmt.swiglu_alpha,
            fmt.swiglu_limit)
    return layout

# ---- plain-torch fp32 model (same rounding points; only the summation order differs) ----

def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K]: the values the kernel multiplies the weights by (int8 per block of 32, scale
    max|x| / 127, round half to even)."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # a true division
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def mxfp4_native_reference(expert: Mxfp4NativeExpert, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 model of :meth:`Mxfp4NativeExpert.forward` (fp32 [n, H])."""
    h = quantize_activations(rows.float()) @ expert.w13.dequantized().T
    if expert.b13 is not None:
        h = h + expert.b13.float()
    a = gate_activation(h, expert.fmt)
    y = quantize_activations(a) @ expert.w2.dequantized().T
    if expert.b2 is not None:
        y = y + expert.b2.float()
    return y * weights.float()[:, None]
