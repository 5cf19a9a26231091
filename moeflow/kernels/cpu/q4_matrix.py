"""The int4 matrix form moeflow's CPU kernels multiply (``q4.c``, ``q4z.c``): :class:`Q4Matrix`, its layout
(:func:`pack_q4` / :func:`unpack_q4`, :func:`group_rows`) and the kernel calls on it (:func:`q4_matmul`,
:func:`q4_expert`). The library itself: :mod:`~moeflow.kernels.cpu.native`; the fp32 models:
:mod:`~moeflow.kernels.cpu.matrix_reference`.

The int4 rows are interleaved in groups of 8 (:data:`~moeflow.kernels.cpu.native.ROW_GROUP`) so one multiply
serves 8 rows and a tile of 4 tokens reuses each unpacked block: memory-bound up to ~4 tokens per call (issue 21,
benchmarks/results/cpu_native). An int4 matrix with fp16 scales (AWQ's) keeps them in fp16 with its uint8 zero
points (``Q4_F16Z``, 7% fewer bytes per call at group 128), the kernel forming the fp32 mins exactly: the same
results as fp32 scales and mins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.native import BLOCK, ROW_GROUP, check_alloc, fp32_rows, library
from moeflow.quant.awq import unpack_int4

Q4_F32, Q4_F16Z, Q4_F16Z8 = 0, 1, 2  # q4.c's forms of a q4 matrix's scales and mins (Q4Matrix.fmt)
Q4_0_GROUP = 32  # the one group size of the Q4_F16Z8 form (GGUF's Q4_0 block)


def q4_fmt(scales: torch.Tensor, mins: torch.Tensor) -> int:
    """The form (``Q4_F32``, ``Q4_F16Z``, ``Q4_F16Z8``) of a q4 matrix's scales and mins tensors."""
    if scales.dtype != torch.float16:
        return Q4_F32
    return Q4_F16Z if mins.numel() else Q4_F16Z8


@dataclass
class Q4Matrix:
    """A 4-bit matrix ``W [N, K]`` in the kernels' format: ``W = q * s + m`` per group of ``group_size`` inputs.

    Rows are interleaved in groups of 8 (``q4.c``'s layout: one integer multiply covers 8 rows x 4 features),
    the last ``N % 8`` rows stored plainly; each group's bytes are its rows' bytes of a ``[N, K/2]`` tensor, so a
    range of rows starting and ending at multiples of 8 (or at N) is still a slice of every tensor.

    Three forms (:attr:`fmt`): fp32 scales and mins (``Q4_F32``), or fp16 scales with the uint8 zero points held in
    ``mins``' place (``Q4_F16Z``, m = -zero * s formed in fp32 by the kernel): the same weights and the same
    results bit for bit, 3 instead of 8 bytes per row and group (-7% of the bytes a call reads at group 128).
    :meth:`from_awq` picks the second for fp16 scales (AWQ checkpoints', ``quantize_rtn``'s). The third,
    ``Q4_F16Z8``, is GGUF's Q4_0 (group 32, every zero point 8): fp16 scales and an empty ``mins`` (nothing
    stored or read for the zero points, 18 bytes per row and 32 inputs as in the file); :meth:`from_awq` picks it
    for group 32 with every zero point 8, :meth:`from_q4_0` makes it from the file's blocks. At group 32 the
    integer zero points (``Q4_F16Z``, ``Q4_F16Z8``) are folded into the integer block sums (q4.c), so both forms
    of the same weights give the same bits."""

    packed: torch.Tensor  # uint8 [N, K/2], row-grouped (see group_rows)
    scales: torch.Tensor  # fp32 or fp16 [N, K/g], row-grouped
    mins: torch.Tensor  # fp32 [N, K/g] (= -zero * scale), or with fp16 scales uint8 zeros [N, K/g] (or uint8 [0]:
    # every zero point 8); row-grouped
    group_size: int

    @classmethod
    def from_q4_0(cls, codes: torch.Tensor, d: torch.Tensor) -> Q4Matrix:
        """GGUF Q4_0 rows as stored (:func:`moeflow.quant.ggml.q4_0_codes`): codes uint8 [N, K] in [0, 15], d fp16
        [N, K/32]; the weight ``(codes - 8) * d``, exactly, in the ``Q4_F16Z8`` form."""
        n, k = codes.shape
        if k % Q4_0_GROUP or tuple(d.shape) != (n, k // Q4_0_GROUP) or d.dtype != torch.float16:
            raise ValueError(f"Q4_0 codes {tuple(codes.shape)} / scales {d.dtype} {tuple(d.shape)}: expected codes "
                             f"[N, K] with K % 32 == 0 and fp16 scales [N, K/32]")
        return cls(pack_q4(codes.to(torch.uint8)), group_rows(d.contiguous()), torch.empty(0, dtype=torch.uint8),
                   Q4_0_GROUP)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 compact: bool | None = None, out: Q4Matrix | None = None) -> Q4Matrix:
        """AWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales [K/g, N] (y = x @ W_awq).
        ``compact`` (default: scales are fp16): the ``Q4_F16Z`` form; fp32 scales that are not fp16 numbers
        cannot take it. ``out``: a matrix of this shape and form (views of a host-store region) whose tensors are
        written in place, the packed weights converted straight into them; returned."""
        if group_size % BLOCK or qweight.shape[0] % group_size:
            raise ValueError(f"qweight {tuple(qweight.shape)}, group_size {group_size}: the CPU kernel needs "
                             f"group_size % {BLOCK} == 0 and in_features % group_size == 0")
        from moeflow.kernels.repack import awq_to_q4_packed

        # moves packed words: bit for bit pack_q4 of the unpacked q^T
        packed = awq_to_q4_packed(qweight.cpu(), out=None if out is None else out.packed, lib=library())
        zeros = unpack_int4(qzeros.cpu())
        compact = scales.dtype == torch.float16 if compact is None else compact
        form = out is None  # (else the scales and mins are temporaries, copied into out's)
        if compact:
            half = scales.cpu().half()
            if not torch.equal(half.float(), scales.cpu().float()):
                raise ValueError("Q4Matrix.from_awq(compact=True): the scales are not all fp16 numbers")
            zero8 = group_size == Q4_0_GROUP and (out is None or out.fmt == Q4_F16Z8) and bool((zeros == 8).all())
            mins = torch.empty(0, dtype=torch.uint8) if zero8 else \
                group_rows(zeros.to(torch.uint8).T.contiguous(), form=form)
            made = cls(packed, group_rows(half.T.contiguous(), form=form), mins, group_size)
        else:
            s = scales.cpu().float()
            mins = -zeros.float() * s
            made = cls(packed, group_rows(s.T.contiguous(), form=form), group_rows(mins.T.contiguous(), form=form),
                       group_size)
        if out is None:
            return made
        if made.fmt != out.fmt or made.group_size != out.group_size:
            raise ValueError(f"Q4Matrix.from_awq(out=...): out is form {out.fmt} group {out.group_size}, the "
                             f"tensors give form {made.fmt} group {made.group_size}")
        out.scales.copy_(made.scales)
        out.mins.copy_(made.mins)
        return out

    @property
    def fmt(self) -> int:
        """``Q4_F16Z`` (fp16 scales, uint8 zeros), ``Q4_F16Z8`` (fp16 scales, zeros 8) or ``Q4_F32`` (fp32 scales
        and mins): the kernels' ``fmt``."""
        return q4_fmt(self.scales, self.mins)

    def fp32_form(self) -> Q4Matrix:
        """This matrix in the ``Q4_F32`` form (itself when it is): the same weights."""
        if self.fmt == Q4_F32:
            return self
        s = self.scales.float()
        zeros = self.mins.float() if self.fmt == Q4_F16Z else torch.full_like(s, 8.0)
        return Q4Matrix(self.packed, s, -zeros * s, self.group_size)

    @classmethod
    def concat_rows(cls, parts: list[Q4Matrix]) -> Q4Matrix:
        """One matrix whose rows are ``parts``' rows in order (e.g. q, k, v fused into one). Plain concatenation of
        the tensors where every part but the last has a multiple of 8 rows; else the rows are re-grouped. Parts
        of both forms: the result in the fp32 form."""
        if len({(p.shape[1], p.group_size) for p in parts}) != 1:
            raise ValueError(f"concat_rows: parts of shapes {[p.shape for p in parts]} and group sizes "
                             f"{[p.group_size for p in parts]}: in_features and group_size must agree")
        if len({p.fmt for p in parts}) > 1:
            # (the fp32 form's kernel at group 32 is not the integer-zero one: results of the parts change slightly)
            parts = [p.fp32_form() for p in parts]
        if all(p.shape[0] % ROW_GROUP == 0 for p in parts[:-1]):
            return cls(*(hugepages.cat([getattr(p, f) for p in parts]) for f in ("packed", "scales", "mins")),
                       parts[0].group_size)
        q = torch.cat([unpack_q4(p.packed) for p in parts])
        s = torch.cat([group_rows(p.scales, inverse=True) for p in parts])
        if parts[0].fmt == Q4_F16Z8:
            return cls(pack_q4(q), group_rows(s), parts[0].mins, parts[0].group_size)
        m = torch.cat([group_rows(p.mins, inverse=True) for p in parts])
        return cls(pack_q4(q), group_rows(s), group_rows(m), parts[0].group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, N] (``x @ W.T``)."""
        return q4_matmul(x, self.packed, self.scales, self.mins, self.group_size)

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K]: the weight the kernel multiplies by."""
        g, f = self.group_size, self.fp32_form()
        s, m = group_rows(f.scales, inverse=True), group_rows(f.mins, inverse=True)
        return unpack_q4(self.packed).float() * s.repeat_interleave(g, 1) + m.repeat_interleave(g, 1)

    @property
    def nbytes(self) -> int:
        return q4_nbytes(self.packed, self.scales, self.mins)


def group_rows(t: torch.Tensor, inverse: bool = False, form: bool = True) -> torch.Tensor:
    """Per-row values [N, C] (scales, mins) <-> the kernel's order: within each group of 8 rows, [C, 8]. ``form``:
    the kernel's order is a weight form to keep (on huge pages: :mod:`~moeflow.kernels.cpu.hugepages`), else a
    temporary."""
    n, c = t.shape
    whole = n - n % ROW_GROUP
    g = t[:whole].reshape(whole // ROW_GROUP, *((c, ROW_GROUP) if inverse else (ROW_GROUP, c)))
    parts = [g.transpose(1, 2).reshape(whole, c), t[whole:]]
    return hugepages.cat(parts) if form and not inverse else torch.cat(parts).contiguous()


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in [0, 15] -> packed uint8 [N, K/2] in q4.c's layout."""
    n, k = q.shape
    whole = n - n % ROW_GROUP
    # grouped rows: [group, row r, block b, c, nibble h, j] (feature 32b + 8c + 4h + j) -> bytes [group, b, c, r, j]
    g = q[:whole].reshape(whole // ROW_GROUP, ROW_GROUP, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    grouped = (g[..., 0] | (g[..., 1] << 4)).reshape(whole, k // 2)
    tail = q[whole:].reshape(n - whole, k // BLOCK, 2, BLOCK // 2)  # plain rows: byte j = q[j] | q[16 + j] << 4
    return hugepages.cat([grouped, (tail[:, :, 0] | (tail[:, :, 1] << 4)).reshape(n - whole, k // 2)])


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_q4`: uint8 [N, K] in [0, 15]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    whole = n - n % ROW_GROUP
    nib = torch.stack([packed & 0xF, packed >> 4], -1)  # [N, K/2, 2]
    g = nib[:whole].reshape(whole // ROW_GROUP, k // BLOCK, 4, ROW_GROUP, 4, 2).permute(0, 3, 1, 2, 5, 4)
    tail = nib[whole:].reshape(n - whole, k // BLOCK, BLOCK // 2, 2).transpose(2, 3)
    return torch.cat([g.reshape(whole, k), tail.reshape(n - whole, k)])


def q4_nbytes(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> int:
    """Bytes a q4 matrix's kernel call reads (its tensors, either form)."""
    return packed.numel() + scales.numel() * scales.element_size() + mins.numel() * mins.element_size()


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """:meth:`Q4Matrix.matmul` on the matrix's tensors (no object per call: the decode step's hot path)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = fp32_rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32)
    fmt = q4_fmt(scales, mins)
    if fmt == Q4_F16Z8 and group_size != Q4_0_GROUP:
        raise ValueError(f"q4 matrix without zero points (Q4_F16Z8) needs group size 32, got {group_size}")
    check_alloc(library().mf_q4_linear(rows.data_ptr(), rows.shape[0], k, n, group_size, fmt, packed.data_ptr(),
                                       scales.data_ptr(), mins.data_ptr(), y.data_ptr(), torch.get_num_threads()),
                "q4 linear")
    return y


def q4_expert(x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, weights: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """One SwiGLU expert in one call: x fp32 [T, H], w13 [2I, H] (gate then up), w2 [H, I], routing weights
    fp32 [T] -> ``weights[:, None] * (silu(x W1.T) * (x W3.T)) W2.T``, fp32 [T, H]; added into ``out`` when given."""
    h = w2.shape[0]
    inter = w2.shape[1]
    rows = fp32_rows(x, h)
    w = weights.to(torch.float32).contiguous()
    acc = out is not None
    if out is None:
        out = torch.empty((rows.shape[0], h), dtype=torch.float32)
    if w13.fmt != w2.fmt:
        w13, w2 = w13.fp32_form(), w2.fp32_form()
    check_alloc(library().mf_q4_expert(
        rows.data_ptr(), rows.shape[0], h, inter, w13.group_size, w13.fmt, w13.packed.data_ptr(), w13.scales.data_ptr(),
        w13.mins.data_ptr(), w2.packed.data_ptr(), w2.scales.data_ptr(), w2.mins.data_ptr(), w.data_ptr(),
        out.data_ptr(), int(acc), torch.get_num_threads()), "q4 expert")
    return out
