"""MXFP4 experts (gpt-oss's published storage) with biases and a gate activation.

Loader form as published (:mod:`moeflow.kernels.experts.mxfp4_reference`): ``w13_blocks`` uint8 ``[2I, H/32, 16]``,
``w13_scales`` uint8 ``[2I, H/32]``, ``w2_blocks`` ``[H, I/32, 16]``, ``w2_scales`` ``[H, I/32]`` (w13 rows gate
first, then up); ``dtype`` is the bias dtype. The region holds them in K panels (:meth:`MXFP4Format.panels`:
``P13``, ``P2`` = 64 at gpt-oss's sizes): ``w13_blocks`` ``[H/P13, 2I, P13/32, 16]``, ``w13_scales``
``[H/P13, 2I, P13/32]``, ``w2_*`` likewise with ``I/P2`` panels of ``H`` rows, so the rows of a kernel tile in one
panel are one contiguous range (the same bytes per expert); the blocks' bits are permuted within each 32-bit word
(:func:`~moeflow.kernels.experts.mxfp4_reference.to_kernel_layout`). Kernels: :mod:`moeflow.kernels.experts.mxfp4`
(Triton), :mod:`moeflow.kernels.cpu.mxfp4_native` (CPU: ``mxfp4.c`` on the region's bytes;
:mod:`moeflow.kernels.cpu.mxfp4`'s torch int4 digits where it does not build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.experts.mxfp4_reference import (  # the bit tables of the kernel layout (static_weights)
    _FROM_KERNEL,
    BLOCK,
    E2M1_VALUES,
    _half_word_luts,
    dequantize_mxfp4,
    from_kernel_layout,
    from_panels,
    panel_for,
    to_kernel_layout,
    to_panels,
)
from moeflow.kernels.formats.biased import BiasedExpertFormat

if TYPE_CHECKING:
    from moeflow.kernels.experts.capturable import StaticWeights
    from moeflow.kernels.experts.ops import Alloc
    from moeflow.kernels.formats.layout import ExpertPool, ReferenceWeights


@dataclass(frozen=True)
class MXFP4Format(BiasedExpertFormat):
    kind: ClassVar[str] = "mxfp4"
    has_triton: ClassVar[bool] = True
    cpu_kernels: bool = False  # CPU pools computed by mxfp4.c (backend "cpu"), not the torch reference

    def with_cpu_kernels(self) -> MXFP4Format:
        """This format with ``cpu_kernels``: its pools on the CPU (``device="cpu"``: resident experts and slots)
        computed by the native kernel on the slots' bytes (:mod:`moeflow.kernels.cpu.mxfp4_native`, the CPU form's
        kernel, so slots and hybrid compute give the same bits) where backend "torch" would run the fp32
        reference. A ValueError where the kernels do not build."""
        from moeflow.kernels.cpu.native import native_available

        if not native_available():
            raise ValueError("MXFP4 experts cannot use the CPU kernels: moeflow's CPU kernels do not build here (no C "
                             "compiler, or MOEFLOW_CPU_NATIVE=0)")
        return dataclasses.replace(self, cpu_kernels=True)

    def forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend, *,
                config=None, validate=None):  # noqa: D102 (see ExpertFormat.forward)
        if self.cpu_kernels and backend == "torch" and x.device.type == "cpu":
            backend = "cpu"  # the biased op's name for the native kernel (cpu_pool_forward)
        return super().forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend,
                               config=config, validate=validate)

    def capture_unsupported(self, backend: str) -> str | None:
        if self.cpu_kernels and backend == "torch":
            return "MXFP4 experts computed by moeflow's native CPU kernel (cpu_kernels) are not device work"
        return super().capture_unsupported(backend)

    def cpu_pool_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         pool: ExpertPool, slot_of_expert: torch.Tensor, out: torch.Tensor,
                         expert_mask: torch.Tensor | None) -> None:
        """out[pairs of selected experts] (``[T*k, H]``) = weighted outputs of a CPU pool's experts (x ``[T, H]``,
        topk_ids / topk_weights ``[T, k]``), each computed on its slot's bytes by the native kernel, all its
        rows at once (a token's result does not depend on the batch)."""
        from moeflow.kernels.cpu.mxfp4_native import region_layout

        buffer = pool.buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.dim() != 2 \
                or buffer.shape[1] != self.nbytes:
            raise ValueError(f"MXFP4 CPU pool: expected a contiguous CPU uint8 [n_slots, {self.nbytes}] buffer, got "
                             f"{tuple(buffer.shape)} strides {buffer.stride()}")
        layout = region_layout(self, buffer[0], {name: v[0] for name, v in pool.tensors.items()})
        k, n_slots, base = topk_ids.shape[1], buffer.shape[0], buffer.data_ptr()
        mask = None if expert_mask is None else expert_mask.tolist()
        slots = slot_of_expert.tolist()
        groups: dict[int, list[int]] = {}
        for pair, e in enumerate(topk_ids.reshape(-1).tolist()):
            groups.setdefault(e, []).append(pair)
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        flat_w = topk_weights.reshape(-1).float().contiguous()
        direct = out.dtype == x.dtype == torch.float32 and out.is_contiguous()
        for e, pairs in groups.items():
            if mask is not None and not mask[e]:
                continue
            if not 0 <= slots[e] < n_slots:
                raise ValueError(f"MXFP4 CPU pool: expert {e} is in slot {slots[e]}, outside the pool's {n_slots}")
            at = base + slots[e] * self.nbytes
            if len(pairs) == 1 and direct:  # (a decode step: one row per expert, written in place)
                p = pairs[0]
                layout.forward_at(at, xf[p // k:p // k + 1], flat_w[p:p + 1], out[p:p + 1])
                continue
            idx = torch.tensor(pairs)
            y = torch.empty((len(pairs), layout.hidden), dtype=torch.float32)
            layout.forward_at(at, xf[idx // k], flat_w[idx].contiguous(), y)
            out[idx] = y.to(x.dtype).to(out.dtype)  # (rounded as Mxfp4NativeExpert.forward returns it)

    @property
    def panels(self) -> tuple[int, int]:
        """K per panel of the region's (w13, w2) matrices (module doc; K = H for w13, I for w2)."""
        return panel_for(self.hidden_size), panel_for(self.intermediate_size)

    def weight_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        if H % BLOCK or I % BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({H}) and intermediate ({I}) sizes divisible by {BLOCK}")
        p13, p2 = self.panels
        return [("w13_blocks", torch.uint8, (H // p13, 2 * I, p13 // BLOCK, BLOCK // 2)),
                ("w13_scales", torch.uint8, (H // p13, 2 * I, p13 // BLOCK)),
                ("w2_blocks", torch.uint8, (I // p2, H, p2 // BLOCK, BLOCK // 2)),
                ("w2_scales", torch.uint8, (I // p2, H, p2 // BLOCK))]

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        """Blocks and scales as published (row-major ``[N, K/32, 16]`` / ``[N, K/32]``), the biases as stored."""
        return {spec.name: _row_major(spec.shape) if spec.name[-7:] in ("_blocks", "_scales") else spec.shape
                for spec in self.specs}

    def to_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name[-7:] in ("_blocks", "_scales"):
            panel = self.panels[0 if name.startswith("w13") else 1]
            return to_panels(to_kernel_layout(t) if name.endswith("_blocks") else t, panel)
        return t

    def from_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith("_blocks"):
            return from_kernel_layout(from_panels(t))
        if name.endswith("_scales"):
            return from_panels(t).clone(memory_format=torch.contiguous_format)
        return t.clone()

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        t = pool.tensors
        w13, w2 = (dequantize_mxfp4(from_kernel_layout(from_panels(t[f"{m}_blocks"][slot])),
                                    from_panels(t[f"{m}_scales"][slot])) for m in ("w13", "w2"))
        b13, b2 = (t["w13_bias"][slot].float(), t["w2_bias"][slot].float()) if self.bias else (None, None)
        return w13, b13, w2, b2

    def triton_forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config, alloc=None):
        from moeflow.kernels.experts.mxfp4 import mxfp4_expert_forward

        return mxfp4_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config=config,
                                    alloc=alloc)

    def static_weights(self, pool: ExpertPool, alloc: Alloc) -> StaticWeights:
        """:meth:`reference_weights` on the device (exact: the same table lookups and ``ldexp``), its tables in
        ``alloc``'s buffers."""
        dev, t = pool.device, pool.tensors
        lo_cpu, hi_cpu = _half_word_luts(tuple(_FROM_KERNEL))
        lo, hi = (alloc(n, (65536,), torch.int32, dev) for n in ("mxfp4_lo", "mxfp4_hi"))
        lut = alloc("e2m1", (16,), torch.float32, dev)
        lo.copy_(lo_cpu)
        hi.copy_(hi_cpu)
        lut.copy_(torch.tensor(E2M1_VALUES, dtype=torch.float32))

        def dequant(m: str, slot: torch.Tensor) -> torch.Tensor:
            blocks = from_panels(t[f"{m}_blocks"].index_select(0, slot)[0]).contiguous()  # [N, K/32, 16]
            scales = from_panels(t[f"{m}_scales"].index_select(0, slot)[0])  # [N, K/32]
            word = blocks.view(torch.int32)
            blocks = (lo[(word & 0xFFFF).long()] | hi[((word >> 16) & 0xFFFF).long()]).view(torch.uint8)
            values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
            w = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].to(torch.float32))
            return w.flatten(-2)

        def weights_of(slot: torch.Tensor):
            b13 = t["w13_bias"].index_select(0, slot)[0].float() if self.bias else None
            b2 = t["w2_bias"].index_select(0, slot)[0].float() if self.bias else None
            return dequant("w13", slot), b13, dequant("w2", slot), b2
        return weights_of

    def cpu_unsupported(self) -> str | None:
        return None

    def cpu_expert(self, tensors: dict[str, torch.Tensor]):  # -> Mxfp4NativeExpert | Mxfp4CpuExpert
        """The CPU form of an expert from its loader-form ``tensors`` (a disk read, or :meth:`loader_tensors`):
        written once into a region of its own and computed there by ``mxfp4.c`` (1x the expert's bytes), or,
        where moeflow's CPU kernels do not build, torch's int4 digit form (2.35x, :mod:`moeflow.kernels.cpu.mxfp4`)."""
        from moeflow.kernels.cpu.native import native_available

        if native_available():
            region = torch.zeros(self.nbytes, dtype=torch.uint8)
            self.write(region, {k: v.cpu() for k, v in tensors.items()})
            return self._native_form(region)
        from moeflow.kernels.cpu.mxfp4 import Mxfp4CpuExpert

        return Mxfp4CpuExpert.from_tensors(tensors, self)

    def cpu_region_expert(self, region: torch.Tensor):  # -> Mxfp4NativeExpert | None
        """The CPU form of the expert in ``region`` ``uint8 [nbytes]``: views of its blocks, scales and biases as
        stored, computed in place by ``mxfp4.c`` (no copy, no extra RAM); None off the CPU or where the kernels do
        not build."""
        from moeflow.kernels.cpu.native import native_available

        if region.device.type != "cpu" or not native_available():
            return None
        if region.dtype != torch.uint8 or tuple(region.shape) != (self.nbytes,):
            raise ValueError(f"an MXFP4 expert region is uint8 [{self.nbytes}], got {region.dtype} "
                             f"{tuple(region.shape)}")
        return self._native_form(region)

    def _native_form(self, region: torch.Tensor):  # -> Mxfp4NativeExpert
        from moeflow.kernels.cpu.mxfp4_native import Mxfp4NativeExpert

        return Mxfp4NativeExpert.from_views({k: v[0] for k, v in self.views(region.view(1, -1)).items()}, self)


def _row_major(panel_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Region shape ``(K/P, N, P/32, ...)`` -> the published ``(N, K/32, ...)``."""
    n_panels, rows, per_panel, *rest = panel_shape
    return (rows, n_panels * per_panel, *rest)
