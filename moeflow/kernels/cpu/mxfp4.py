"""MXFP4 experts (gpt-oss) computed on the CPU with torch's int4 kernels, the weights represented exactly.

torch has no MXFP4 CPU kernel, and one int4 grid cannot hold e2m1: a block's values are
``m * 2**(e - 128)`` with ``m = 2 * e2m1`` in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, 15 levels on a non-uniform
grid, while the int4 format is ``(q - 8) * scale + zero``, 16 uniform levels. So each weight is split in two
int4 digits, ``m = 4 * hi + lo`` with ``hi, lo`` in [-3, 3] (12 = 4*3 + 0, 6 = 4*1 + 2, 3 = 4*0 + 3, ...), the
high digits with scale ``2**(e - 126)``, the low ones with ``2**(e - 128)``, zero 0: both powers of two, exact in
bf16. The two digit matrices are stacked along K (``W' = [Hi | Lo]`` of ``[N, 2K]``) and the activations
duplicated (``x' = [x | x]``), so ``x' @ W'.T = x @ W.T`` with every weight exact, in one call of
``_weight_int4pack_mm_for_cpu`` (group size 32 = the MXFP4 block, so no group straddles the two halves).

Error against the fp32 reference (:func:`mxfp4_cpu_expert_reference` models it): the weights are exact; the
activations are rounded to bf16 (the kernel's fast path, as :mod:`moeflow.kernels.cpu.int4`), products are
accumulated in fp32 and each matmul's output is rounded to bf16: the relative error of one matmul is that of
one bf16 rounding (~2**-9, measured ~3e-3 max-relative at gpt-oss shapes), the same class as the AWQ CPU path.

Cost (``benchmarks/bench_cpu_mxfp4.py``): the kernel reads 1 byte per weight plus 8 bytes per 32 weights of
scale/zero pairs, 1.25 B/weight against MXFP4's 0.53: the CPU form takes ~2.4x the expert's MXFP4 bytes of
extra RAM (converted once, when loading finishes, as the AWQ form). The alternative that keeps no extra RAM,
dequantizing to bf16 per call, was 12-19x slower on the machine we measured (a byte-to-value table gather per
weight and call; docs/hybrid.md has the numbers). Biased experts only: ``w13`` rows are gate then up
(:mod:`moeflow.kernels.experts.biased`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.kernels.cpu.int4 import COMPUTE_DTYPE, INNER_K_TILES, _repack_block
from moeflow.kernels.experts.biased import gate_activation
from moeflow.kernels.experts.mxfp4_reference import BLOCK, check_mxfp4, dequantize_mxfp4
from moeflow.kernels.formats.layout import ExpertFormat


def _code_table() -> torch.Tensor:
    """int32 [256]: for an MXFP4 byte, the int4 codes ``8 + digit`` (uint8 each) of (hi even, hi odd, lo even,
    lo odd), where 2 * e2m1 = 4 * hi + lo with hi, lo in [-3, 3] (2 * |e2m1| is 0, 1, 2, 3, 4, 6, 8, 12)."""
    m = torch.tensor((0, 1, 2, 3, 4, 6, 8, 12) * 2) * torch.tensor([1] * 8 + [-1] * 8)  # by 4-bit code
    hi = torch.div(m.abs(), 4, rounding_mode="floor") * m.sign()
    lo = m - 4 * hi
    byte = torch.arange(256)
    even, odd = byte & 15, byte >> 4
    table = torch.stack((hi[even], hi[odd], lo[even], lo[odd]), dim=-1) + 8
    return table.to(torch.uint8).contiguous().view(torch.int32).view(256)


_CODE_TABLE = _code_table()


def _digit_codes(blocks: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [N, G, 16] -> the int4 codes uint8 [N, 2K] of ``[Hi | Lo]`` (``K = 32 G``): one table
    gather per byte (byte arithmetic over the codes was ~10x slower in torch)."""
    N = blocks.shape[0]
    four = _CODE_TABLE[blocks.to(torch.int32)].view(torch.uint8).view(N, -1, 2, 2)  # [N, K/2, hi|lo, even|odd]
    return four.transpose(1, 2).reshape(N, -1)  # [N, 2K]: the hi codes in k order, then the lo codes


def _int4pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> torch's CPU int4pack uint8 [N, K/2], with byte ops where the layout is known.

    The layout probed by :mod:`moeflow.kernels.cpu.int4`: per block of ``b`` rows (64 with AVX-512, 32 with
    AVX2), a ``[K, b/2]`` byte array whose byte (k, j) holds row j in its low nibble and row b/2 + j in its high.
    """
    N, K = q.shape
    block = _repack_block()
    if not block or N % block or K % 2:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES)
    halves = q.view(N // block, 2, block // 2, K)
    return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous().view(N, K // 2)


@dataclass
class Mxfp4Int4Matrix:
    """One MXFP4 matrix ``W [N, K]`` (``nn.Linear`` orientation) as two exact int4 digit matrices stacked along K."""

    packed: torch.Tensor  # uint8, torch's CPU int4pack of the int4 codes [N, 2K]
    scales_zeros: torch.Tensor  # bf16 [2K/32, N, 2]

    @classmethod
    def from_mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4") -> Mxfp4Int4Matrix:
        """blocks uint8 [N, K/32, 16], scales uint8 [N, K/32] (the published layout)."""
        check_mxfp4(blocks, scales, name)
        blocks, scales = blocks.cpu(), scales.cpu()
        exponent = scales.to(torch.int32)
        if int(exponent.max()) > 253:  # the high digits' scale 2**(e - 126) must stay finite in bf16
            raise ValueError(f"{name}: MXFP4 scale exponent {int(exponent.max())} is beyond bf16's range (<= 253)")
        packed = _int4pack(_digit_codes(blocks))
        unit = torch.ldexp(torch.ones(()), (exponent - 128).float())  # [N, G]: 2**(e-128), exact in fp32
        scale = torch.cat((unit * 4.0, unit), dim=1)  # m/2 * 2**(e-127) = hi * 2**(e-126) + lo * 2**(e-128)
        sz = torch.stack((scale.T, torch.zeros_like(scale.T)), dim=-1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, sz)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> x @ W.T [M, N] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat((x, x), dim=1), self.packed, BLOCK,
                                                          self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


@dataclass
class Mxfp4CpuExpert:
    """One gpt-oss expert (MXFP4 weights, biases, clamped SwiGLU) in the CPU int4 digit form."""

    w13: Mxfp4Int4Matrix
    w2: Mxfp4Int4Matrix
    b13: torch.Tensor | None  # fp32 [2I]
    b2: torch.Tensor | None  # fp32 [H]
    fmt: ExpertFormat  # the MXFP4Format: activation, swiglu_alpha, swiglu_limit

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], fmt: ExpertFormat) -> Mxfp4CpuExpert:
        """t: one expert's loader-form tensors as :class:`~moeflow.kernels.formats.MXFP4Format` names them."""
        bias = fmt.bias
        return cls(Mxfp4Int4Matrix.from_mxfp4(t["w13_blocks"], t["w13_scales"], "w13"),
                   Mxfp4Int4Matrix.from_mxfp4(t["w2_blocks"], t["w2_scales"], "w2"),
                   t["w13_bias"].float().cpu() if bias else None, t["w2_bias"].float().cpu() if bias else None, fmt)

    def forward(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [n, H] (any float dtype), routing weights fp32 [n] -> weighted output [n, H] in rows' dtype."""
        h = self.w13.matmul(rows.to(COMPUTE_DTYPE)).float()
        if self.b13 is not None:
            h = h + self.b13
        a = gate_activation(h, self.fmt).to(COMPUTE_DTYPE)
        y = self.w2.matmul(a).float()
        if self.b2 is not None:
            y = y + self.b2
        return (y * weights[:, None]).to(rows.dtype)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def mxfp4_cpu_expert_reference(t: dict[str, torch.Tensor], fmt, rows: torch.Tensor,
                               weights: torch.Tensor) -> torch.Tensor:
    """Plain-torch model of :meth:`Mxfp4CpuExpert.forward` (exact weights, the same bf16 rounding points)."""
    w13 = dequantize_mxfp4(t["w13_blocks"], t["w13_scales"])
    w2 = dequantize_mxfp4(t["w2_blocks"], t["w2_scales"])
    bias = fmt.bias
    h = (rows.to(COMPUTE_DTYPE).float() @ w13.T).to(COMPUTE_DTYPE).float()
    if bias:
        h = h + t["w13_bias"].float()
    a = gate_activation(h, fmt).to(COMPUTE_DTYPE).float()
    y = (a @ w2.T).to(COMPUTE_DTYPE).float()
    if bias:
        y = y + t["w2_bias"].float()
    return (y * weights[:, None]).to(rows.dtype)
