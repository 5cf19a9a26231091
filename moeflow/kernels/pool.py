"""How one expert's weights are laid out in memory, and typed views of a pool of expert slots.

One expert is one contiguous byte region (so a host->device transfer is one copy, or one copy per
matrix when chunked). A pool is a ``uint8 [n_slots, nbytes]`` buffer; :meth:`ExpertFormat.views`
turns it into the typed tensors ``[n_slots, ...]`` that the kernels read. The host store uses the
same format with one "slot" per (layer, expert), so a slot and a host region are byte-identical.

The region holds the *kernel layout*, converted once in :meth:`ExpertFormat.write` from the tensors the
loader produces (AWQ as published, or dense ``nn.Linear`` weights); :meth:`ExpertFormat.loader_tensors`
is its exact inverse. The bytes per expert are the same as AWQ's (the conversion only moves nibbles).

Loader form (H = hidden, I = intermediate, g = AWQ group size):

* ``dense``: ``w13`` ``[2I, H]`` (``nn.Linear`` layout, rows of w1 (gate) first, then w3 (up)), ``w2`` ``[H, I]``.
* ``awq``: ``w13_qweight`` int32 ``[H, 2I/8]``, ``w13_qzeros`` int32 ``[H/g, 2I/8]``, ``w13_scales``
  ``[H/g, 2I]`` (columns of w1 first, then w3), ``w2_qweight`` int32 ``[I, H/8]``, ``w2_qzeros`` int32
  ``[I/g, H/8]``, ``w2_scales`` ``[I/g, H]``; AWQ's nibble order (``moeflow.quant.awq.AWQ_ORDER``).

Kernel layout (what :meth:`ExpertFormat.views` returns), for a matrix ``y = x @ W`` with W ``[K, N]``:

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
  accumulator tile holds both halves of ``silu(gate) * up``. Dense ``w2`` is unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

import torch

ALIGN = 256  # byte alignment of every tensor inside an expert region (and of the region size)
MAX_PANEL = 128  # k per qweight panel at most: the decode tile's BLOCK_K (every shipped BLOCK_K divides a panel)

DENSE_NAMES = ("w13", "w2")
AWQ_NAMES = ("w13_qweight", "w13_qzeros", "w13_scales", "w2_qweight", "w2_qzeros", "w2_scales")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the expert region

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExpertFormat:
    """Shapes and byte layout of one expert. ``dtype`` is the dense weight dtype or the AWQ scale dtype."""

    hidden_size: int
    intermediate_size: int
    kind: Literal["dense", "awq"]
    dtype: torch.dtype
    group_size: int | None = None
    specs: tuple[TensorSpec, ...] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        if self.kind == "dense":
            shapes = [("w13", self.dtype, (2 * I, H)), ("w2", self.dtype, (H, I))]
        elif self.kind == "awq":
            g = self.group_size
            if g is None or H % g or I % g or H % 8 or I % 8:
                raise ValueError(
                    f"AWQ expert format needs hidden ({H}) and intermediate ({I}) sizes divisible by "
                    f"the group size ({g}) and by 8"
                )
            p = awq_panel(g)
            shapes = [
                ("w13_qweight", torch.int32, (H // p, 2 * I, p // 8)),
                ("w13_qzeros", torch.int32, (H // g, 2 * I // 8)),
                ("w13_scales", self.dtype, (H // g, 2 * I)),
                ("w2_qweight", torch.int32, (I // p, H, p // 8)),
                ("w2_qzeros", torch.int32, (I // g, H // 8)),
                ("w2_scales", self.dtype, (I // g, H)),
            ]
        else:
            raise ValueError(f"unknown expert format kind {self.kind!r} (expected 'dense' or 'awq')")
        specs, offset = [], 0
        for name, dtype, shape in shapes:
            spec = TensorSpec(name, dtype, shape, offset)
            specs.append(spec)
            offset = _round_up(offset + spec.nbytes, ALIGN)
        object.__setattr__(self, "specs", tuple(specs))
        object.__setattr__(self, "nbytes", offset)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def spec(self, name: str) -> TensorSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(f"expert format {self.kind!r} has no tensor {name!r}; it has {self.names}")

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views ``name -> [n_slots, *shape]`` into ``buffer`` (``uint8 [n_slots, nbytes]``)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != self.nbytes:
            raise ValueError(
                f"expert buffer must be uint8 [n_slots, {self.nbytes}], got {buffer.dtype} {tuple(buffer.shape)}"
            )
        out = {}
        for s in self.specs:
            raw = buffer[:, s.offset : s.offset + s.nbytes]
            out[s.name] = raw.view(s.dtype).view(buffer.shape[0], *s.shape)
        return out

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the loader form (AWQ as published / dense ``nn.Linear``) of each tensor."""
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size  # noqa: E741
        if self.kind == "dense":
            return {"w13": (2 * I, H), "w2": (H, I)}
        return {"w13_qweight": (H, 2 * I // 8), "w13_qzeros": (H // g, 2 * I // 8), "w13_scales": (H // g, 2 * I),
                "w2_qweight": (I, H // 8), "w2_qzeros": (I // g, H // 8), "w2_scales": (I // g, H)}

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's loader-form tensors into the kernel layout in its region ``uint8 [nbytes]``.

        Checks names, shapes and dtypes (int32 for packed AWQ tensors); see the module docstring for both forms.
        """
        views = self.views(region.view(1, -1))
        want = self.loader_shapes()
        for name, shape in want.items():
            if name not in tensors:
                raise KeyError(f"missing expert tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"expert tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            if (name.endswith("qweight") or name.endswith("qzeros")) and t.dtype != torch.int32:
                raise ValueError(f"expert tensor {name!r} must be int32 (packed AWQ), got {t.dtype}")
        for name, t in tensors.items():
            if name in want:
                write_kernel_layout(views[name][0], name, t.to(self.spec(name).dtype), self.intermediate_size,
                                    self.group_size)

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Exact inverse of :meth:`write`: the loader-form tensors (AWQ as published, or dense) of one region."""
        views = self.views(region.view(1, -1))
        return {name: from_kernel_layout(name, views[name][0], self.intermediate_size) for name in self.names}

    def awq_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """The AWQ tensors as published (``w13_qweight [H, 2I/8]``, ...) of one region ``uint8 [nbytes]``.

        What the CPU int4 path (``Int4Expert.from_awq_tensors``) takes; bit-exact inverse of :meth:`write`.
        """
        if self.kind != "awq":
            raise ValueError(f"awq_tensors: expert format is {self.kind!r}, not 'awq'")
        return self.loader_tensors(region)


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


@dataclass
class ExpertPool:
    """A pool of expert slots on one device: typed views of a ``uint8 [n_slots, nbytes]`` buffer."""

    fmt: ExpertFormat
    buffer: torch.Tensor  # uint8 [n_slots, nbytes]
    tensors: dict[str, torch.Tensor] = field(init=False)
    checked: bool = field(default=False, init=False, repr=False)  # views validated once (they never change)

    def __post_init__(self) -> None:
        self.tensors = self.fmt.views(self.buffer)

    @classmethod
    def allocate(cls, fmt: ExpertFormat, n_slots: int, device: torch.device | str) -> ExpertPool:
        return cls(fmt, torch.empty((n_slots, fmt.nbytes), dtype=torch.uint8, device=device))

    @property
    def n_slots(self) -> int:
        return self.buffer.shape[0]

    @property
    def device(self) -> torch.device:
        return self.buffer.device


def row_major_pool(pool: ExpertPool) -> ExpertPool:
    """The same AWQ experts with both qweights copied into the former row-major layout ``[S, N, K/8]`` and viewed
    as panels (:func:`rows_as_panels`): what the kernels read through strides for the side-by-side timing of the
    two layouts (the MXFP4 twin: :func:`moeflow.kernels.mxfp4.row_major_copy`). Marked checked: its row stride is
    not the panel layout's, which the pool checks would refuse."""
    alt = copy.copy(pool)
    alt.tensors = dict(pool.tensors)
    for name in ("w13_qweight", "w2_qweight"):
        alt.tensors[name] = rows_as_panels(qweight_rows(pool.tensors[name]), awq_panel(pool.fmt.group_size))
    alt.checked = True
    return alt
