"""GGUF experts computed on the CPU from their ggml blocks as the file stores them (``gguf.c``): Q4_0, Q8_0, Q4_K,
Q5_K and Q6_K weights times int8 activations, the way llama.cpp's CPU backend pairs them (Q8_0 activations in
blocks of 32 for Q4_0 and Q8_0 weights, Q8_K's blocks of 256 for the K-quants), so Q4_K_M files (Q4_K with Q6_K
down projections) and Q8_0 files run hybrid compute and ``device="cpu"`` without converting a byte.

The CPU form of an expert (:class:`GGUFCpuExpert`) is its three matrices' bytes (uint8 ``[rows, row_bytes]``, the
region's or the loader form's) and their block types: it keeps no other copy, and a call reads exactly the
expert's file bytes (gate and up row by row in one pass, then down). The exception: Q4_K matrices of the experts
resident over a mapped file, repacked at load into rows interleaved 8 at a time (:data:`Q4_K_X8`,
:mod:`moeflow.kernels.cpu.gguf_repack`), which give the same bits as their Q4_K blocks.

Numerics (:func:`gguf_expert_reference` is the fp32 model): activations rounded to int8 per block (scale
max|x| / 127, round half to even), weights exact, each block's integer sum exact, fp32 across blocks; the
AVX-512 VNNI, AVX2 and portable builds give the same bits and a token's result does not depend on the batch
(``gguf.c``'s comment states the order of operations).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.kernels.cpu.native import check_rc, declared_library
from moeflow.kernels.cpu.q4k_x8_form import K_BLOCK, Q4_K_X8, unpack_q4k_x8
from moeflow.kernels.experts.gguf_reference import GGMLType, dequantize, ggml_type

CPU_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the block types gguf.c computes


def cpu_type(t: str | int | GGMLType) -> GGMLType:
    """The block type ``t`` if the CPU kernels compute it, else a ValueError naming the ones they do."""
    g = t if isinstance(t, GGMLType) else ggml_type(t)
    if g.name not in CPU_TYPES and g != Q4_K_X8:
        raise ValueError(f"GGUF {g.name} experts have no CPU kernels: the CPU computes {', '.join(CPU_TYPES)}")
    return g


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.mf_gguf_linear.argtypes = [p, i, i, i, i, p, i64, p, i]
    lib.mf_gguf_expert.argtypes = [p, i, i, i, i, p, p, i64, i, p, i64, p, p, i, i]
    lib.mf_gguf_dequant_rows.argtypes = [i, p, i, i, i64, p]
    lib.mf_gguf_linear.restype = lib.mf_gguf_expert.restype = lib.mf_gguf_dequant_rows.restype = i


def _lib() -> ctypes.CDLL:
    return declared_library(_signatures, "GGUF experts cannot be computed on the CPU")


def _matrix(w: torch.Tensor, g: GGMLType, k: int, name: str) -> int:
    """Checks ``w`` (uint8 [rows, >= row_bytes], rows of contiguous blocks) and returns its row stride in bytes."""
    if w.dtype != torch.uint8 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"GGUF {name}: expected a CPU uint8 [rows, row_bytes] tensor, got {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    if k % g.block_size or w.shape[1] < g.row_bytes(k) or (w.shape[0] > 1 and w.stride(1) != 1):
        raise ValueError(f"GGUF {name}: {g.name} rows of {k} inputs are {g.row_bytes(k)} contiguous bytes (k a "
                         f"multiple of {g.block_size}), got shape {tuple(w.shape)} strides {w.stride()}")
    if g == Q4_K_X8 and (w.shape[0] % 8 or not w.is_contiguous() or w.shape[1] != g.row_bytes(k)):
        raise ValueError(f"GGUF {name}: a {g.name} matrix is contiguous groups of 8 rows, got shape {tuple(w.shape)} "
                         f"strides {w.stride()} for {k} inputs")
    return w.stride(0)


def _fp32(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()


def gguf_linear(x: torch.Tensor, w: torch.Tensor, t: str | int | GGMLType, k: int) -> torch.Tensor:
    """x [M, k] (any float dtype) @ W.T -> fp32 [M, N] for W of block type ``t``: ``w`` uint8 [N, >= row_bytes]
    (rows of blocks, as the file stores them)."""
    g = cpu_type(t)
    stride = _matrix(w, g, k, "matrix")
    rows = _fp32(x, k)
    y = torch.empty((rows.shape[0], w.shape[0]), dtype=torch.float32)
    check_rc(_lib().mf_gguf_linear(rows.data_ptr(), rows.shape[0], k, w.shape[0], g.type_id, w.data_ptr(), stride,
                                    y.data_ptr(), torch.get_num_threads()), f"gguf {g.name} linear")
    return y


DEQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the block types dequantize_rows takes


def dequantize_rows(rows: torch.Tensor, t: str | int | GGMLType, k: int) -> torch.Tensor:
    """K-quant rows (``rows`` uint8 [n, >= row_bytes], CPU; :data:`DEQUANT_TYPES`) -> fp32 [n, k]: ggml's values,
    the fp32 operations of :func:`moeflow.quant.ggml.dequantize` in its order (the same bits) in one native call
    (a token embedding's lookup: ~100 us of torch operations per Q4_K row otherwise)."""
    g = cpu_type(t)
    if g.name not in DEQUANT_TYPES:
        raise ValueError(f"dequantize_rows takes {', '.join(DEQUANT_TYPES)} blocks, not {g.name}")
    stride = _matrix(rows, g, k, "rows")
    out = torch.empty((rows.shape[0], k), dtype=torch.float32)
    check_rc(_lib().mf_gguf_dequant_rows(g.type_id, rows.data_ptr(), rows.shape[0], k, stride, out.data_ptr()),
             f"gguf {g.name} rows")
    return out


class GGUFLinear(nn.Module):
    """``y = x @ W.T`` for ``W [out, in]`` held as a GGUF file stores it (``blocks`` uint8 ``[out, row_bytes]`` of
    block type ``t``, computed by :func:`gguf_linear`): a file's lm_head on its own blocks (a Q4_K_M file's Q6_K
    ``output.weight``: 0.82 bytes per weight where the int8 head reads 1.0 plus scales; a Q8_0 one: 1.06, the
    file's weights exactly), gpt-oss's Q8_0 attention projections. fp32 model:
    :func:`gguf_linear_reference` of the same blocks."""

    def __init__(self, blocks: torch.Tensor, t: str | int | GGMLType, in_features: int) -> None:
        super().__init__()
        self.type = cpu_type(t)
        _matrix(blocks, self.type, in_features, "linear")
        self.register_buffer("blocks", blocks, persistent=False)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("bias", None, persistent=False)

    def set_bias(self, bias: torch.Tensor) -> None:
        """Add ``bias [out]`` to every output (a biased projection's bias, kept unquantized in fp32)."""
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, this GGUF layer has {self.out_features} outputs")
        self.bias = bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (any float dtype) -> [..., out] in x's dtype (fp32 compute; + bias where set)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features in its last dimension, this GGUF {self.type.name} "
                             f"layer takes {self.in_features}")
        y = gguf_linear(x.reshape(-1, self.in_features), self.blocks, self.type, self.in_features)
        if self.bias is not None:
            y += self.bias
        return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes read per call (the blocks)."""
        return self.type.row_bytes(self.in_features) * self.out_features


@dataclass
class GGUFCpuExpert:
    """One SwiGLU expert as GGUF blocks: ``gate``, ``up`` uint8 ``[I, >= row_bytes]`` of ``gate_up_type``, ``down``
    uint8 ``[H, >= row_bytes]`` of ``down_type`` (views of a region or the loader form: no copy is made; a type
    :data:`Q4_K_X8`: the interleaved copy of Q4_K rows, contiguous ``[rows, row_bytes]``)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_up_type: GGMLType
    down_type: GGMLType

    def __post_init__(self) -> None:
        self.gate_up_type, self.down_type = cpu_type(self.gate_up_type), cpu_type(self.down_type)
        hidden, inter = self.hidden_size, self.intermediate_size
        if self.up.shape[0] != inter or self.up.stride() != self.gate.stride():
            raise ValueError(f"GGUF expert: gate {tuple(self.gate.shape)} and up {tuple(self.up.shape)} must have "
                             "the same shape and strides")
        self._s13 = _matrix(self.gate, self.gate_up_type, hidden, "gate")
        _matrix(self.up, self.gate_up_type, hidden, "up")
        self._s2 = _matrix(self.down, self.down_type, inter, "down")

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], gate_up_type: str | GGMLType,
                     down_type: str | GGMLType) -> GGUFCpuExpert:
        """t: one expert's ``gate``, ``up``, ``down`` (the GGUF format's loader form)."""
        return cls(t["gate"], t["up"], t["down"], ggml_type(gate_up_type) if isinstance(gate_up_type, str)
                   else gate_up_type, ggml_type(down_type) if isinstance(down_type, str) else down_type)

    @property
    def hidden_size(self) -> int:
        return self.down.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[0]

    def forward(self, rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [n, H] (any float dtype), routing weights [n] -> weighted output [n, H] in rows' dtype (fp32
        ``out`` [n, H] given: added into it and returned)."""
        h = self.hidden_size
        x = _fp32(rows, h)
        w = weights.to(torch.float32).contiguous()
        acc = out is not None
        y = out if acc else torch.empty((x.shape[0], h), dtype=torch.float32)
        if acc and (y.dtype != torch.float32 or not y.is_contiguous() or tuple(y.shape) != (x.shape[0], h)):
            raise ValueError(f"GGUFCpuExpert.forward(out=...): expected contiguous fp32 {(x.shape[0], h)}")
        if x.shape[0] == 0:
            return y if acc else y.to(rows.dtype)
        check_rc(_lib().mf_gguf_expert(
            x.data_ptr(), x.shape[0], h, self.intermediate_size, self.gate_up_type.type_id, self.gate.data_ptr(),
            self.up.data_ptr(), self._s13, self.down_type.type_id, self.down.data_ptr(), self._s2, w.data_ptr(),
            y.data_ptr(), int(acc), torch.get_num_threads()),
            f"gguf {self.gate_up_type.name}/{self.down_type.name} expert")
        return y if acc else y.to(rows.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks a call reads (the expert's file bytes)."""
        return (2 * self.gate_up_type.row_bytes(self.hidden_size) * self.intermediate_size
                + self.down_type.row_bytes(self.intermediate_size) * self.hidden_size)


# ---- plain-torch fp32 models (same rounding points; only the summation order differs) ----

def quantize_activations(x: torch.Tensor, t: str | int | GGMLType) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K]: the values the kernel multiplies weights of type ``t`` by (int8 per block of
    32 for Q4_0 and Q8_0, 256 for the K-quants; scale max|x| / 127, round half to even)."""
    block = 32 if cpu_type(t).name in ("Q4_0", "Q8_0") else K_BLOCK
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    # a true fp32 division, as the kernel's (torch's ``127.0 / amax`` multiplies by a rounded reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def gguf_linear_reference(x: torch.Tensor, w: torch.Tensor, t: str | int | GGMLType, k: int) -> torch.Tensor:
    """fp32 model of :func:`gguf_linear`."""
    g = cpu_type(t)
    if g == Q4_K_X8:  # (the interleaved form's values are its Q4_K rows')
        w, g = unpack_q4k_x8(w, k), ggml_type("Q4_K")
    return quantize_activations(x.float(), g) @ dequantize(w[:, : g.row_bytes(k)].contiguous(), g.name).T


def gguf_expert_reference(expert: GGUFCpuExpert, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 model of :meth:`GGUFCpuExpert.forward` (fp32 [n, H])."""
    h, t13, t2 = expert.hidden_size, expert.gate_up_type, expert.down_type
    x = rows.float()
    g, u = (gguf_linear_reference(x, m, t13, h) for m in (expert.gate, expert.up))
    a = F.silu(g) * u
    return gguf_linear_reference(a, expert.down, t2, expert.intermediate_size) * weights.float()[:, None]
