"""The int8 matrix form moeflow's CPU kernels multiply (``q8.c``): :class:`Q8Matrix`, its layout
(:func:`group_q8`) and the kernel call on it (:func:`q8_matmul`). The int8 rows are interleaved in groups of 8
(:data:`~moeflow.kernels.cpu.native.ROW_GROUP`) as the int4 ones (:mod:`~moeflow.kernels.cpu.q4_matrix`),
converted once at load (the stored checkpoint is not changed). The library itself:
:mod:`~moeflow.kernels.cpu.native`; the fp32 model: :func:`~moeflow.kernels.cpu.matrix_reference.q4_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.native import BLOCK, ROW_GROUP, check_alloc, fp32_rows, library


@dataclass
class Q8Matrix:
    """An 8-bit matrix ``W [N, K] = q * s[:, None]`` (q int8 in [-127, 127], one fp32 scale per row) in
    ``q8.c``'s layout: rows interleaved in groups of 8 (one integer multiply covers 8 rows x 4 features), the
    last ``N % 8`` rows stored plainly. Each group's bytes are its rows' bytes of a ``[N, K]`` tensor and the
    scales stay in row order, so a range of rows starting and ending at multiples of 8 (or at N) is a slice."""

    weight: torch.Tensor  # int8 [N, K], row-grouped (see group_q8)
    scales: torch.Tensor  # fp32 [N]

    @classmethod
    def from_rows(cls, q: torch.Tensor, scales: torch.Tensor) -> Q8Matrix:
        """From plain rows: q int8 [N, K] (K % 32 == 0), scales [N] (any float dtype; held in fp32)."""
        if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] % BLOCK:
            raise ValueError(f"int8 weight {q.dtype} {tuple(q.shape)}: the CPU kernel needs an int8 [out, in] "
                             f"matrix with in_features % {BLOCK} == 0")
        if tuple(scales.shape) != (q.shape[0],):
            raise ValueError(f"int8 scales {tuple(scales.shape)} for a weight {tuple(q.shape)}: expected one per row")
        return cls(group_q8(q.cpu()), scales.detach().cpu().float().contiguous())

    @classmethod
    def concat_rows(cls, parts: list[Q8Matrix]) -> Q8Matrix:
        """One matrix whose rows are ``parts``' rows in order (as
        :meth:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix.concat_rows`)."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"concat_rows: parts of shapes {[p.shape for p in parts]}: in_features must agree")
        scales = torch.cat([p.scales for p in parts])
        if all(p.shape[0] % ROW_GROUP == 0 for p in parts[:-1]):
            return cls(hugepages.cat([p.weight for p in parts]), scales)
        return cls(group_q8(torch.cat([group_q8(p.weight, inverse=True) for p in parts])), scales)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scales.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, N] (``x @ W.T``)."""
        return q8_matmul(x, self.weight, self.scales)

    def matmul_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, len(ids)]: ``matmul(x)[:, ids]`` for a few rows ids (int64 [n]),
        the same bits, reading only those rows (the int4 lm_head's recomputed candidates; one thread)."""
        n, k = self.weight.shape
        rows = fp32_rows(x, k)
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n):
            raise IndexError(f"row ids {ids.tolist()} out of range for a q8 matrix of {n} rows")
        y = torch.empty((rows.shape[0], ids.numel()), dtype=torch.float32)
        check_alloc(library().mf_q8_linear_rows(rows.data_ptr(), rows.shape[0], k, n, self.weight.data_ptr(),
                                                self.scales.data_ptr(), ids.data_ptr(), ids.numel(), y.data_ptr()),
                    "q8 rows")
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 codes of rows ``ids`` (int64 [...]) in plain order: int8 [..., K] (an embedding lookup, a
        few rows recomputed) without ungrouping the matrix."""
        n, k = self.weight.shape
        whole = n - n % ROW_GROUP
        flat = ids.reshape(-1)
        grouped = self.weight[:whole].view(whole // ROW_GROUP, k // BLOCK, BLOCK // 4, ROW_GROUP, 4)
        if whole == n:
            out = grouped[flat // ROW_GROUP, :, :, flat % ROW_GROUP]
        else:
            out = torch.empty((flat.numel(), k), dtype=torch.int8)
            inside = flat < whole
            g = flat[inside]
            out[inside] = grouped[g // ROW_GROUP, :, :, g % ROW_GROUP].reshape(-1, k)
            out[~inside] = self.weight[flat[~inside]]
        return out.reshape(*ids.shape, k)

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K]: the weight the kernel multiplies by."""
        return group_q8(self.weight, inverse=True).float() * self.scales[:, None]


def group_q8(q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """int8 rows [N, K] <-> q8.c's layout: within each group of 8 rows, per 32-feature block b, bytes
    [c, r, j] = row r's feature 32b + 4c + j."""
    n, k = q.shape
    whole = n - n % ROW_GROUP
    shape = (k // BLOCK, BLOCK // 4, ROW_GROUP, 4) if inverse else (ROW_GROUP, k // BLOCK, BLOCK // 4, 4)
    order = (0, 3, 1, 2, 4) if inverse else (0, 2, 3, 1, 4)  # [group, b, c, r, j] <-> [group, r, b, c, j]
    g = q[:whole].reshape(whole // ROW_GROUP, *shape).permute(*order)
    if inverse:
        g = g.reshape(whole, k)  # a copy
        return g if whole == n else torch.cat([g, q[whole:]])
    out = hugepages.empty((n, k), q.dtype)  # the weight form: written once (a 600 MB lm_head), on huge pages
    out[:whole].view(g.shape).copy_(g)
    out[whole:] = q[whole:]
    return out


def q8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:meth:`Q8Matrix.matmul` on the matrix's tensors: x [M, K] (any float dtype) @ (weight int8 [N, K],
    row-grouped, * scales fp32 [N, 1]).T -> fp32 [M, N]."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weight {tuple(weight.shape)}: the CPU kernel needs in_features % {BLOCK} == 0")
    rows = fp32_rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32)
    check_alloc(library().mf_q8_linear(rows.data_ptr(), rows.shape[0], k, n, weight.data_ptr(), scales.data_ptr(),
                                       y.data_ptr(), torch.get_num_threads()), "q8 linear")
    return y
