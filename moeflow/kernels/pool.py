"""How one expert's weights are laid out in memory, and typed views of a pool of expert slots.

One expert is one contiguous byte region (so a host->device transfer is one copy, or one copy per
matrix when chunked). A pool is a ``uint8 [n_slots, nbytes]`` buffer; :meth:`ExpertFormat.views`
turns it into the typed tensors ``[n_slots, ...]`` that the kernels read. The host store uses the
same format with one "slot" per (layer, expert), so a slot and a host region are byte-identical.

Tensor names and shapes (H = hidden, I = intermediate, g = AWQ group size):

* ``dense``: ``w13`` ``[2I, H]`` (``nn.Linear`` layout, rows of w1 (gate) first, then w3 (up)),
  ``w2`` ``[H, I]``.
* ``awq``: ``w13_qweight`` int32 ``[H, 2I/8]``, ``w13_qzeros`` int32 ``[H/g, 2I/8]``,
  ``w13_scales`` ``[H/g, 2I]`` (columns of w1 first, then w3), ``w2_qweight`` int32 ``[I, H/8]``,
  ``w2_qzeros`` int32 ``[I/g, H/8]``, ``w2_scales`` ``[I/g, H]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

ALIGN = 256  # byte alignment of every tensor inside an expert region (and of the region size)

DENSE_NAMES = ("w13", "w2")
AWQ_NAMES = ("w13_qweight", "w13_qzeros", "w13_scales", "w2_qweight", "w2_qzeros", "w2_scales")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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
            shapes = [
                ("w13_qweight", torch.int32, (H, 2 * I // 8)),
                ("w13_qzeros", torch.int32, (H // g, 2 * I // 8)),
                ("w13_scales", self.dtype, (H // g, 2 * I)),
                ("w2_qweight", torch.int32, (I, H // 8)),
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

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one expert's tensors into its byte region ``uint8 [nbytes]`` (checks names, shapes, dtypes)."""
        views = self.views(region.view(1, -1))
        for s in self.specs:
            if s.name not in tensors:
                raise KeyError(f"missing expert tensor {s.name!r}")
            t = tensors[s.name]
            if tuple(t.shape) != s.shape:
                raise ValueError(f"expert tensor {s.name!r} has shape {tuple(t.shape)}, expected {s.shape}")
            views[s.name][0].copy_(t.to(s.dtype))


@dataclass
class ExpertPool:
    """A pool of expert slots on one device: typed views of a ``uint8 [n_slots, nbytes]`` buffer."""

    fmt: ExpertFormat
    buffer: torch.Tensor  # uint8 [n_slots, nbytes]
    tensors: dict[str, torch.Tensor] = field(init=False)

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
