"""The plain formats' kernel layout (dense and AWQ experts, what the plain Triton kernels read) and its exact
conversions from and to the loader form: pure permutations of nibbles, rows and columns.

Loader form (H = hidden, I = intermediate, g = AWQ group size):

* dense: ``w13`` ``[2I, H]`` (``nn.Linear`` layout, rows of w1 (gate) first, then w3 (up)), ``w2`` ``[H, I]``.
* AWQ: ``w13_qweight`` int32 ``[H, 2I/8]``, ``w13_qzeros`` int32 ``[H/g, 2I/8]``, ``w13_scales``
  ``[H/g, 2I]`` (columns of w1 first, then w3), ``w2_qweight`` int32 ``[I, H/8]``, ``w2_qzeros`` int32
  ``[I/g, H/8]``, ``w2_scales`` ``[I/g, H]``; AWQ's nibble order (``moeflow.quant.awq.AWQ_ORDER``).

Kernel layout (what the pool's views are), for a matrix ``y = x @ W`` with W ``[K, N]``:

* ``*_qweight`` int32 ``[K/P, N, P/8]``, panel-major: K is cut into panels of ``P = awq_panel(g)`` (the group,
  at most 128) and each panel holds every output column's P consecutive k, K-contiguous; nibble ``i`` (bits
  4i..4i+3) of word ``(p, n, j)`` is ``q[pP + 8j + i, n]``. A 16-byte load gives one output column 32
  consecutive k, and a kernel tile of BLOCK_N columns x P k (one K iteration) is one contiguous range of
  ``BLOCK_N * P / 2`` bytes (8 KiB for 128 x 128), where a ``[N, K/8]`` layout would spread it over BLOCK_N
  runs of P/2 bytes, K/2 bytes apart: whole DRAM pages per iteration instead of 64-byte pieces of each.
  :func:`qweight_rows` gives the ``[N, K/8]`` view of the same nibbles (a copy) for the references.
* ``*_qzeros`` int32 ``[K/g, N/8]``: nibble ``i`` of word ``(r, c)`` is the zero of column ``8c + i``.
* ``*_scales`` ``[K/g, N]`` as published.
* w13 (and dense ``w13``): gate and up columns interleaved, column ``2j`` is gate j, ``2j + 1`` up j, so one
  accumulator tile holds both halves of ``silu(gate) * up``. Dense ``w2`` is unchanged. The bytes per expert are
  the same as AWQ's (the conversion only moves nibbles).
"""

from __future__ import annotations

import torch

MAX_PANEL = 128  # k per qweight panel at most: the decode tile's BLOCK_K (every shipped BLOCK_K divides a panel)

DENSE_NAMES = ("w13", "w2")
AWQ_NAMES = ("w13_qweight", "w13_qzeros", "w13_scales", "w2_qweight", "w2_qzeros", "w2_scales")


def awq_panel(group_size: int) -> int:
    """k per panel of the kernel layout's ``qweight``: the largest power of two dividing the AWQ group, at most
    ``MAX_PANEL`` (the group itself for the usual 32 / 64 / 128). The kernels cap BLOCK_K (a power of two) at
    the panel, so every K tile lies in one panel."""
    return min(group_size & -group_size, MAX_PANEL)


def rows_as_panels(rows: torch.Tensor, panel: int) -> torch.Tensor:
    """A row-major ``qweight [..., N, K/8]`` (K-contiguous rows) as a strided ``[..., K/P, N, P/8]`` view the
    kernels read like the panel-major layout (no copy): the layout the pool had before, kept for the GPU
    benchmark's side-by-side timing of the two."""
    *lead, n, words = rows.shape
    return rows.unflatten(-1, (words // (panel // 8), panel // 8)).transpose(-3, -2)


def qweight_rows(qweight: torch.Tensor) -> torch.Tensor:
    """Kernel-layout ``qweight [..., K/P, N, P/8]`` -> int32 ``[..., N, K/8]`` (word ``(n, j)`` holds
    k = 8j..8j+7 of column n): a contiguous copy, for the plain-torch references."""
    *lead, panels, n, words = qweight.shape
    return qweight.transpose(-3, -2).reshape(*lead, n, panels * words)



# ----------------------------------------------------------------------------------------------------------
# loader form <-> kernel layout (pure permutations of nibbles, rows and columns: exact both ways)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _unpack(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C]; column 8c + j of the result is nibble ``order[j]`` of word c."""
    shifts = _SHIFTS[list(order)].to(packed.device)
    q = (packed.unsqueeze(-1) >> shifts) & 0xF
    return q.to(torch.uint8).reshape(packed.shape[0], -1)


def _pack(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """uint8 [R, C] in [0, 15] -> int32 [R, C/8]; nibble i of word c holds column 8c + order[i]."""
    v = values.to(torch.int32).reshape(values.shape[0], -1, 8)
    out = torch.zeros(v.shape[:2], dtype=torch.int32, device=values.device)
    for nibble, column in enumerate(order):
        out |= v[:, :, column] << (4 * nibble)  # int32 wraps: the bit pattern is what counts
    return out


_NATURAL = (0, 1, 2, 3, 4, 5, 6, 7)


def _interleave_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[.., 2I, ..] with halves (a, b) along ``dim`` -> (a0, b0, a1, b1, ...)."""
    a, b = t.chunk(2, dim=dim)
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def _split_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_interleave_halves`."""
    shape = list(t.shape)
    pairs = t.unflatten(dim, (shape[dim] // 2, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def to_kernel_layout(name: str, t: torch.Tensor, inter: int, group_size: int | None = None) -> torch.Tensor:
    """One loader-form tensor -> its kernel layout (see the module docstring); ``group_size`` (AWQ) sets the
    qweight panel. The qweights move packed words (:func:`moeflow.kernels.repack.awq_to_panels`); bit for bit
    :func:`to_kernel_layout_reference`."""
    if name.endswith("qweight"):
        if group_size is None:
            raise ValueError(f"to_kernel_layout({name!r}): the AWQ group size sets the qweight panel; none given")
        from moeflow.kernels.cpu.native import library
        from moeflow.kernels.repack import awq_to_panels

        return awq_to_panels(t, awq_panel(group_size), interleave=name.startswith("w13"),
                             lib=library() if t.device.type == "cpu" else None)
    return to_kernel_layout_reference(name, t, inter, group_size)


def write_kernel_layout(dst: torch.Tensor, name: str, t: torch.Tensor, inter: int, group_size: int | None) -> None:
    """:func:`to_kernel_layout` of ``t`` into ``dst`` (its kernel-layout shape, e.g. a region's view): a qweight
    is converted straight into ``dst`` (on ``dst``'s device: a CUDA region converts on the GPU after one copy of the
    packed words), the small tensors through :func:`to_kernel_layout_reference`."""
    if name.endswith("qweight") and group_size is not None and dst.is_contiguous():
        from moeflow.kernels.cpu.native import library
        from moeflow.kernels.repack import awq_to_panels

        awq_to_panels(t.to(dst.device), awq_panel(group_size), interleave=name.startswith("w13"), out=dst,
                      lib=library() if dst.device.type == "cpu" else None)
        return
    dst.copy_(to_kernel_layout(name, t, inter, group_size))


def to_kernel_layout_reference(name: str, t: torch.Tensor, inter: int, group_size: int | None = None
                               ) -> torch.Tensor:
    """:func:`to_kernel_layout` by unpacking every nibble (the reference the fast qweight path is tested against,
    and the path of the small tensors: scales, zeros, dense weights)."""
    w13 = name.startswith("w13")
    if name == "w13":
        return _interleave_halves(t, 0)
    if name == "w2":
        return t
    if name.endswith("scales"):
        return _interleave_halves(t, 1) if w13 else t
    from moeflow.quant.awq import AWQ_REVERSE_ORDER

    q = _unpack(t, AWQ_REVERSE_ORDER)  # [rows, N] natural columns
    if w13:
        q = _interleave_halves(q, 1)
    if name.endswith("qzeros"):
        return _pack(q, _NATURAL)
    rows = _pack(q.T.contiguous(), _NATURAL)  # [N, K/8], K-contiguous
    if group_size is None:
        raise ValueError(f"to_kernel_layout({name!r}): the AWQ group size sets the qweight panel; none given")
    n, words = rows.shape
    p8 = awq_panel(group_size) // 8
    return rows.view(n, words // p8, p8).transpose(0, 1).contiguous()  # [K/P, N, P/8]


def from_kernel_layout(name: str, t: torch.Tensor, inter: int) -> torch.Tensor:
    """Inverse of :func:`to_kernel_layout`."""
    w13 = name.startswith("w13")
    if name == "w13":
        return _split_halves(t, 0).contiguous()
    if name == "w2":
        return t.clone()
    if name.endswith("scales"):
        return (_split_halves(t, 1) if w13 else t).contiguous()
    from moeflow.quant.awq import AWQ_ORDER

    if name.endswith("qweight"):
        t = qweight_rows(t)  # [N, K/8]
    q = _unpack(t, _NATURAL)
    if name.endswith("qweight"):
        q = q.T
    if w13:
        q = _split_halves(q, 1)
    return _pack(q.contiguous(), AWQ_ORDER)
