"""Expert compute on the CPU with torch's own int4 kernels (``_weight_int4pack_mm_for_cpu``).

AWQ stores ``W = (q - z) * s`` with an integer zero ``z``; torch's int4 format stores
``W = (q - 8) * s + zero`` with a float zero, so ``zero = (8 - z) * s``. The kernel is fast only with
bf16 activations (fp16/fp32 take a slow path, 20-30x slower on the machines we measured), so the
expert runs in bf16 whatever the model dtype: results differ from the fp32 reference by bf16 rounding
of the activations (relative error ~3e-3 per matmul).

Where moeflow's own CPU kernels build (:mod:`moeflow.kernels.cpu.native`: int8 activations, integer dot products,
2x to 4x faster than torch's int4 kernel on AVX2), :class:`Int4Expert` holds its experts in that format instead
and runs each expert in one call (fp32 in and out, no bf16 rounding; its numerics are stated there).

Memory: the packed weight is ``uint8 [N, K/2]`` (the same bytes as AWQ's qweight) plus bf16
scale-and-zero pairs ``[K/g, N, 2]`` (4 bytes per group and column, AWQ needs 2.5): about 1.1x the AWQ
expert size in RAM, converted once when the expert is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.kernels.cpu.matrix_reference import q4_expert_reference
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, q4_expert
from moeflow.quant.awq import unpack_int4

COMPUTE_DTYPE = torch.bfloat16
INNER_K_TILES = 2


def int4_cpu_available() -> bool:
    """Whether this torch build has the int4 CPU kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def _repack_bytes(qweight: torch.Tensor, block: int) -> torch.Tensor:
    """AWQ qweight int32 [K, N/8] -> torch's CPU int4pack uint8 [N, K/2], with byte ops only.

    The CPU int4pack layout (torch 2.6-2.13, found by probing; ``block`` is 64 columns where torch runs its
    AVX-512 kernels, 32 where it runs AVX2): per block of columns, a ``[K, block/2]`` byte array whose byte
    (k, j) holds column j in its low nibble and column block/2 + j in its high one. In AWQ those two columns
    sit in words block/16 apart, in the same nibble, so the repack is a word transpose plus nibble shuffles
    (several times faster than unpack + ``_convert_weight_to_int4pack_for_cpu``, and 4x less temporary memory).
    """
    K, n8 = qweight.shape
    words_per_block = block // 8
    nb = n8 // words_per_block
    half = words_per_block // 2
    words = qweight.contiguous().view(K, nb, words_per_block).permute(1, 0, 2).contiguous()  # [N/block, K, w]
    u = words.view(torch.uint8).view(nb, K, 2, half, 4)  # (low | high columns) x word x byte
    lo, hi = u[:, :, 0], u[:, :, 1]
    lows = (lo & 0xF) | (hi << 4)  # even AWQ nibbles of the byte
    highs = (lo >> 4) | (hi & 0xF0)  # odd AWQ nibbles
    # column t of a word is AWQ nibble AWQ_REVERSE_ORDER[t] = byte [0,2,0,2,1,3,1,3][t], low/high half
    out = torch.stack([lows[..., 0], lows[..., 2], highs[..., 0], highs[..., 2],
                       lows[..., 1], lows[..., 3], highs[..., 1], highs[..., 3]], dim=-1)
    return out.view(n8 * 8, K // 2)


_REPACK_BLOCK: int | None = None  # 0: no byte repack matches this torch build


def _repack_block() -> int:
    """Probe once which column block torch's int4pack uses here (the layout is not a public API)."""
    global _REPACK_BLOCK
    if _REPACK_BLOCK is None:
        q = torch.randint(-(2**31), 2**31 - 1, (128, 16), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int64).to(torch.int32)
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q).T.contiguous(), INNER_K_TILES)
        _REPACK_BLOCK = next((b for b in (64, 32) if tuple(ref.shape) == (128, 64)
                              and torch.equal(_repack_bytes(q, b), ref)), 0)
    return _REPACK_BLOCK


def awq_to_int4pack_cpu(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight int32 [K, N/8] -> uint8 [N, K/2] for ``_weight_int4pack_mm_for_cpu``."""
    block = _repack_block()
    if block and qweight.shape[1] % (block // 8) == 0 and qweight.shape[0] % 2 == 0:
        return _repack_bytes(qweight, block)
    q = unpack_int4(qweight).T.contiguous()  # int32 [N, K]
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)


@dataclass
class Int4Matrix:
    """One AWQ matrix in torch's CPU int4 format: ``y = x @ W`` with W ``[K, N]``."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales_zeros: torch.Tensor  # bf16 [K/g, N, 2]
    group_size: int

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Matrix:
        """qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales [K/g, N] (AWQ GEMM layout)."""
        s = scales.cpu().float()
        zero = (8.0 - unpack_int4(qzeros.cpu()).float()) * s
        packed = awq_to_int4pack_cpu(qweight.cpu())
        sz = torch.stack([s, zero], dim=-1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, sz, group_size)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


def native_format_fits(group_size: int) -> bool:
    """Whether AWQ matrices of this group size go to moeflow's own CPU kernels (built here, groups of 32k)."""
    return group_size % 32 == 0 and native_available()


def cpu_expert_kernel() -> str:
    """Which kernels :class:`Int4Expert` runs here, with the C sources' revision (cost-model calibrations are
    keyed by it, so a changed kernel is timed again instead of planned with the old one's rates)."""
    from moeflow.kernels.cpu.native import SIMD_NAMES, library, source_digest

    lib = library()
    if lib is None:
        return "torch int4"
    return f"moeflow cpu_native {SIMD_NAMES[lib.mf_simd()]} {source_digest()}"


@dataclass
class Int4Expert:
    """One expert (fused gate/up ``w13`` and down ``w2``) in a CPU int4 format: moeflow's own
    (:class:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix`) where it builds, else torch's (:class:`Int4Matrix`)."""

    w13: Int4Matrix | Q4Matrix
    w2: Int4Matrix | Q4Matrix
    intermediate_size: int

    @classmethod
    def from_awq_tensors(cls, t: dict[str, torch.Tensor], group_size: int, out: Int4Expert | None = None
                         ) -> Int4Expert:
        """t: one expert's tensors named as :class:`~moeflow.kernels.pool.ExpertFormat` ("awq") names them.
        ``out``: an expert in moeflow's q4 form (views of a host-store region) to convert into, in place."""
        if out is not None:
            if not (out.native and native_format_fits(group_size)):
                raise ValueError("Int4Expert.from_awq_tensors(out=...): converting in place needs moeflow's q4 form")
            Q4Matrix.from_awq(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], group_size, out=out.w13)
            Q4Matrix.from_awq(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], group_size, out=out.w2)
            return out
        make = Q4Matrix.from_awq if native_format_fits(group_size) else Int4Matrix.from_awq
        w13 = make(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], group_size)
        w2 = make(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], group_size)
        return cls(w13, w2, t["w2_qweight"].shape[0])

    @property
    def native(self) -> bool:
        """Whether this expert runs moeflow's own kernels (fp32 activations) rather than torch's (bf16)."""
        return isinstance(self.w13, Q4Matrix)

    def forward(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [n, H] (any float dtype), routing weights fp32 [n] -> weighted output [n, H] in rows' dtype."""
        if self.native:
            return q4_expert(rows, self.w13, self.w2, weights).to(rows.dtype)
        return self.forward_bf16(rows.to(COMPUTE_DTYPE), weights, rows.dtype)

    def forward_bf16(self, rows: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`forward` for rows already in bf16 [n, H] (a layer converts its activations once for all its
        experts): weights fp32 [n] -> weighted output [n, H] in ``out_dtype``, the same numbers."""
        if self.native:
            return q4_expert(rows, self.w13, self.w2, weights).to(out_dtype)
        h = self.w13.matmul(rows).float()
        inter = self.intermediate_size
        a = (F.silu(h[:, :inter]) * h[:, inter:]).to(COMPUTE_DTYPE)
        return (self.w2.matmul(a).float() * weights[:, None]).to(out_dtype)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def int4_expert_reference(t: dict[str, torch.Tensor], group_size: int, rows: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Plain-torch model of :meth:`Int4Expert.forward` for the format ``from_awq_tensors`` picks here (same
    rounding points: int8 activations for moeflow's kernels, bf16 for torch's), for tests."""
    from moeflow.quant.awq import dequantize

    w13 = dequantize(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"].float(), group_size)
    w2 = dequantize(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"].float(), group_size)
    if native_format_fits(group_size):
        return q4_expert_reference(rows, w13.T, w2.T, weights).to(rows.dtype)
    inter = w2.shape[0]
    h = rows.to(COMPUTE_DTYPE).float() @ w13
    a = (F.silu(h[:, :inter]) * h[:, inter:]).to(COMPUTE_DTYPE).float()
    return ((a @ w2) * weights[:, None]).to(rows.dtype)
