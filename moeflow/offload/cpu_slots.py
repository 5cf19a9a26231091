"""Offloading on the CPU at the resident int4 path's speed: experts stored and moved in their CPU int4 form.

On ``device="cpu"`` with AWQ experts and the int4 CPU kernels (``kernels="auto"`` or ``"cpu-int4"``), an
offloading policy's host store and slot pool hold every expert in :class:`CpuInt4Format`: the tensors of the
form :class:`~moeflow.kernels.cpu.int4.Int4Expert` computes with (what the resident CPU int4 path holds),
converted once per expert when the checkpoint is loaded. A slot's ``Int4Expert`` is a set of views of the slot's
bytes, so an expert landing in a slot is one copy of the same bytes through the copy engine (every policy, fence
and transport, and the simulator, work as on a GPU) and a miss converts nothing.

Region of one expert with torch's int4 kernels (``y = x @ W``, W ``[K, N]``, g = group size; H hidden,
I intermediate): ``w13_packed`` uint8 ``[2I, H/2]``, ``w13_scales_zeros`` bf16 ``[H/g, 2I, 2]``, ``w2_packed``
uint8 ``[H, I/2]``, ``w2_scales_zeros`` bf16 ``[I/g, H, 2]`` (gate columns first, then up). The packed weights
are as many bytes as AWQ's qweight; the scale/zero pairs take 4 bytes per group and column where AWQ takes 2.5
(an fp16 scale and a 4-bit zero): **+1.5 bytes per group and column, 1.5 / (g/2 + 2.5) of the AWQ bytes =
+2.3 % at g = 128** (+2.0 % on the embedded model, whose AWQ region carries some alignment padding). The layout is
read off a blank expert's form, so a build whose ``Int4Expert`` uses another matrix format stores that format's
tensors (``nbytes`` / ``awq_nbytes`` give its cost). Moving AWQ bytes instead and deriving the scale/zero pairs
on every miss costs ~90x a region's copy on the embedded model (175 us vs 2 us) and ~3x at issue 21's shapes.

Numerics: the forms are :meth:`Int4Expert.from_awq_tensors`' bytes, each expert runs through its own
``forward`` on all its rows at once, and the k outputs of a token are summed in fp32 in k order, as in
:class:`~moeflow.moe.resident.CpuInt4Experts`: the tokens equal the resident CPU int4 path's for every policy
and slot count (tests/test_invariant.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.step import expert_row, experts_step
from moeflow.kernels.experts import reference
from moeflow.kernels.formats import ALIGN, AWQFormat, ExpertFormat, TensorSpec
from moeflow.kernels.pool import ExpertPool


@dataclass(frozen=True)
class CpuInt4Format(AWQFormat):
    """An AWQ expert format (same shapes, group size and loader tensors) whose region holds the CPU int4 form
    :meth:`Int4Expert.from_awq_tensors` builds (module docstring). Built with :meth:`of`; never equal to the AWQ
    format it came from.

    The region's tensors are the form's own (``w13_<field>`` and ``w2_<field>`` for every tensor field of its
    matrices), laid out from one conversion of a blank expert at construction, so the slots hold exactly what
    the resident CPU int4 path holds, whichever matrix format this build of the kernels uses."""

    awq_nbytes: int = field(init=False, repr=False, compare=False)  # the AWQ region's size, for the record
    _template: Int4Expert = field(init=False, repr=False, compare=False)  # a blank expert: the fields' layout
    fused_moe: ClassVar[bool] = False  # computed by SlotInt4Forms (torch's CPU int4 kernels), never the GPU kernels
    capturable: ClassVar[bool] = False

    @classmethod
    def of(cls, fmt: ExpertFormat) -> CpuInt4Format:
        if type(fmt) is not AWQFormat:
            raise ValueError(f"CpuInt4Format: the int4 CPU layout holds plain AWQ experts, got {fmt!r}")
        return cls(fmt.hidden_size, fmt.intermediate_size, fmt.dtype, fmt.group_size)

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the sizes against the group size, lays out the AWQ region
        object.__setattr__(self, "awq_nbytes", self.nbytes)
        # packed words uninitialized (any bits are valid codes, and only the form's shapes are kept: zeroing 87 MB
        # of a Mixtral expert cost more than the conversion); scales 1, an fp16 number
        blank = {name: (torch.ones(shape, dtype=self.dtype) if name.endswith("scales")
                        else torch.empty(shape, dtype=torch.int32)) for name, shape in self.loader_shapes().items()}
        with hugepages.plain():  # (dropped below: not worth a huge page)
            template = Int4Expert.from_awq_tensors(blank, self.group_size)
        specs, offset = [], 0
        for prefix, matrix in (("w13", template.w13), ("w2", template.w2)):
            for name, t in _tensor_fields(matrix):
                specs.append(TensorSpec(f"{prefix}_{name}", t.dtype, tuple(t.shape), offset))
                offset = -(-(offset + specs[-1].nbytes) // ALIGN) * ALIGN
        # the layout is all the blank is kept for: its tensors become meta tensors (an expert's bytes of RAM freed)
        template = dataclasses.replace(template, **{prefix: _meta_matrix(m) for prefix, m in
                                                    (("w13", template.w13), ("w2", template.w2))})
        object.__setattr__(self, "_template", template)
        object.__setattr__(self, "specs", tuple(specs))
        object.__setattr__(self, "nbytes", offset)

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's AWQ tensors (as published, :meth:`ExpertFormat.loader_shapes`) into its region
        ``uint8 [nbytes]``: the one conversion an expert goes through."""
        for name, shape in self.loader_shapes().items():
            t = tensors.get(name)
            if t is None:
                raise KeyError(f"missing expert tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ValueError(f"expert tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            if not name.endswith("scales") and t.dtype != torch.int32:
                raise ValueError(f"expert tensor {name!r} must be int32 (packed AWQ), got {t.dtype}")
        if self._template.native:  # moeflow's q4 matrices: converted straight into the region's views
            Int4Expert.from_awq_tensors(tensors, self.group_size, out=self.int4_expert(region))
            return
        form = Int4Expert.from_awq_tensors(tensors, self.group_size)
        views = self.views(region.view(1, -1))
        for prefix, matrix in (("w13", form.w13), ("w2", form.w2)):
            for name, t in _tensor_fields(matrix):
                views[f"{prefix}_{name}"][0].copy_(t)

    def forward(self, *args, **kwargs):  # noqa: D102
        raise TypeError("CpuInt4Format slots are computed by SlotInt4Forms (kernels='cpu-int4'), not expert_forward")

    def int4_expert(self, region: torch.Tensor) -> Int4Expert:
        """The :class:`Int4Expert` of a region ``uint8 [nbytes]``: views of its bytes, no copy (it reads whatever
        the region holds when it is called)."""
        v = self.views(region.view(1, -1))
        w13, w2 = (dataclasses.replace(m, **{name: v[f"{prefix}_{name}"][0] for name, _ in _tensor_fields(m)})
                   for prefix, m in (("w13", self._template.w13), ("w2", self._template.w2)))
        return dataclasses.replace(self._template, w13=w13, w2=w2)

    def cpu_region_expert(self, region: torch.Tensor) -> Int4Expert:
        """The region's :class:`Int4Expert` (:meth:`int4_expert`): the CPU form is what the region holds."""
        return self.int4_expert(region)

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        raise ValueError("CpuInt4Format regions hold the CPU int4 form, not AWQ tensors: read them with "
                         "int4_expert(region)")


def _tensor_fields(matrix) -> list[tuple[str, torch.Tensor]]:
    """The tensor fields of one matrix of an :class:`Int4Expert` (a dataclass), in declaration order."""
    return [(f.name, getattr(matrix, f.name)) for f in dataclasses.fields(matrix)
            if isinstance(getattr(matrix, f.name), torch.Tensor)]


def _meta_matrix(matrix):
    """``matrix`` (a dataclass of tensors) with every tensor field replaced by a meta tensor of its shape/dtype."""
    return dataclasses.replace(matrix, **{name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                                          for name, t in _tensor_fields(matrix)})


def int4_expert_of(fmt: ExpertFormat, region: torch.Tensor, *, own: bool = False) -> Int4Expert:
    """The CPU int4 form of the expert in ``region`` (``uint8 [fmt.nbytes]``): views of it for a
    :class:`CpuInt4Format` (copies with ``own=True``, for a region that may be overwritten while the form is
    kept), converted from the AWQ bytes otherwise."""
    if isinstance(fmt, CpuInt4Format):
        return fmt.int4_expert(region.clone() if own else region)
    return Int4Expert.from_awq_tensors(fmt.loader_tensors(region), fmt.group_size)


class SlotInt4Forms:
    """The int4 compute of a CPU slot pool in :class:`CpuInt4Format`: one :class:`Int4Expert` of views per slot."""

    def __init__(self, pool: ExpertPool) -> None:
        if not isinstance(pool.fmt, CpuInt4Format) or pool.device.type != "cpu":
            raise ValueError(f"kernels='cpu-int4' with an offloading policy computes a CPU slot pool in the CPU int4 "
                             f"form (CpuInt4Format), got {type(pool.fmt).__name__} slots on {pool.device}")
        self.pool = pool
        self.forms = [pool.fmt.int4_expert(pool.buffer[s]) for s in range(pool.n_slots)]
        self._summed: tuple[torch.Tensor, torch.Tensor] | None = None  # (the layer's out, its token's summed row)

    def compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor, experts: list[int], slots: list[int]) -> None:
        """Fill the ``out [T*k, H]`` rows of ``experts`` (in slots ``slots``): x [T, H], topk_ids int [T, k],
        topk_weights fp32 [T, k]. Rows in ``x``'s dtype, as :class:`~moeflow.moe.resident.CpuInt4Experts`."""
        k = topk_ids.shape[1]
        flat_w = topk_weights.reshape(-1).float()
        if topk_ids.shape[0] == 1:  # decode: an expert's one pair is its position among the token's k
            ids = topk_ids[0].tolist()
            direct = x.dtype == torch.float32 and out.dtype == torch.float32 and x.is_contiguous() \
                and out.is_contiguous() and flat_w.is_contiguous()
            if direct and len(experts) == k:  # every expert at once (all hits): summed as the resident path sums
                slot_of = dict(zip(experts, slots, strict=True))
                forms = [self.forms[slot_of[e]] for e in ids]
                if all(f.native for f in forms):
                    self._summed = (out, experts_step(x, [(f.w13, f.w2) for f in forms], flat_w.view(1, k)))
                    return
            position = {e: j for j, e in enumerate(ids)}
            # fp32 rows on moeflow's kernels: each weighted row written straight into out (the same numbers)
            for e, slot in zip(experts, slots, strict=True):
                j, form = position[e], self.forms[slot]
                if direct and form.native:
                    expert_row(x, form.w13, form.w2, flat_w, j, out)
                else:
                    out[j:j + 1] = form.forward(x, flat_w[j:j + 1])
            return
        flat_ids = topk_ids.reshape(-1)
        for e, slot in zip(experts, slots, strict=True):
            pairs = torch.nonzero(flat_ids == e).squeeze(1)
            out[pairs] = self.forms[slot].forward(x[pairs // k], flat_w[pairs])

    def combine(self, out: torch.Tensor, top_k: int) -> torch.Tensor:
        """``out [T*k, H]`` -> ``[T, H]``: the fp32 sum in k order of ``kernels.combine``'s torch path, called
        directly (its custom-op dispatch costs more than the sum at decode sizes on the CPU). One fp32 token (the
        decode step): the same adds in the same order, in place on one fresh row (25 -> 6 us at k = 2), or the row
        :meth:`compute` already summed when it ran all k experts in one call (the kernel adds each weighted row
        into the last, as the resident :func:`experts_step` does)."""
        summed, self._summed = self._summed, None
        if summed is not None and summed[0] is out:
            return summed[1]
        return self.sum_rows(out, top_k)

    @staticmethod
    def sum_rows(out: torch.Tensor, top_k: int) -> torch.Tensor:
        """``out [T*k, H]`` -> ``[T, H]``, the sum :meth:`combine` returns when ``compute`` left rows."""
        if out.dtype != torch.float32 or out.shape[0] != top_k or top_k == 1:
            return reference.combine_reference(out, top_k)
        acc = torch.add(out[0:1], out[1:2])
        for j in range(2, top_k):
            acc.add_(out[j:j + 1])
        return acc
