"""Expert compute on the CPU with torch's own int4 kernels (``_weight_int4pack_mm_for_cpu``).

AWQ stores ``W = (q - z) * s`` with an integer zero ``z``; torch's int4 format stores
``W = (q - 8) * s + zero`` with a float zero, so ``zero = (8 - z) * s``. The kernel is fast only with
bf16 activations (fp16/fp32 take a slow path, 20-30x slower on the machines we measured), so the
expert runs in bf16 whatever the model dtype: results differ from the fp32 reference by bf16 rounding
of the activations (relative error ~3e-3 per matmul).

Memory: the packed weight is ``uint8 [N, K/2]`` (the same bytes as AWQ's qweight) plus bf16
scale-and-zero pairs ``[K/g, N, 2]`` (4 bytes per group and column, AWQ needs 2.5): about 1.1x the AWQ
expert size in RAM, converted once when the expert is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.quant.awq import unpack_int4

COMPUTE_DTYPE = torch.bfloat16
INNER_K_TILES = 2


def int4_cpu_available() -> bool:
    """Whether this torch build has the int4 CPU kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass
class Int4Matrix:
    """One AWQ matrix in torch's CPU int4 format: ``y = x @ W`` with W ``[K, N]``."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales_zeros: torch.Tensor  # bf16 [K/g, N, 2]
    group_size: int

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Matrix:
        """qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales [K/g, N] (AWQ GEMM layout)."""
        q = unpack_int4(qweight.cpu()).T.contiguous()  # int32 [N, K]
        s = scales.cpu().float()
        zero = (8.0 - unpack_int4(qzeros.cpu()).float()) * s
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
        sz = torch.stack([s, zero], dim=-1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, sz, group_size)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


@dataclass
class Int4Expert:
    """One expert (fused gate/up ``w13`` and down ``w2``) in torch's CPU int4 format."""

    w13: Int4Matrix
    w2: Int4Matrix
    intermediate_size: int

    @classmethod
    def from_awq_tensors(cls, t: dict[str, torch.Tensor], group_size: int) -> Int4Expert:
        """t: one expert's tensors named as :class:`~moeflow.kernels.pool.ExpertFormat` ("awq") names them."""
        w13 = Int4Matrix.from_awq(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], group_size)
        w2 = Int4Matrix.from_awq(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], group_size)
        return cls(w13, w2, t["w2_qweight"].shape[0])

    def forward(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [n, H] (any float dtype), routing weights fp32 [n] -> weighted output [n, H] in rows' dtype."""
        h = self.w13.matmul(rows.to(COMPUTE_DTYPE)).float()
        inter = self.intermediate_size
        a = (F.silu(h[:, :inter]) * h[:, inter:]).to(COMPUTE_DTYPE)
        y = self.w2.matmul(a).float() * weights[:, None]
        return y.to(rows.dtype)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def int4_expert_reference(t: dict[str, torch.Tensor], group_size: int, rows: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Plain-torch model of :meth:`Int4Expert.forward` (same bf16 rounding points), for tests."""
    from moeflow.quant.awq import dequantize

    w13 = dequantize(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"].float(), group_size)
    w2 = dequantize(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"].float(), group_size)
    inter = w2.shape[0]
    h = rows.to(COMPUTE_DTYPE).float() @ w13
    a = (F.silu(h[:, :inter]) * h[:, inter:]).to(COMPUTE_DTYPE).float()
    return ((a @ w2) * weights[:, None]).to(rows.dtype)
