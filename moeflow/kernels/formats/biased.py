"""Experts with projection biases and a chosen gate activation (gpt-oss), stored dense or AWQ; MXFP4 in
:mod:`.mxfp4`. Computed by :mod:`moeflow.kernels.experts.biased` (see its docstring for the numerics) through the
custom op ``torch.ops.moeflow.biased_expert_forward`` (so ``torch.compile(fullgraph=True)`` traces through it),
which takes the
format as primitive arguments and rebuilds it from :attr:`BiasedExpertFormat.kinds`.

* ``activation``: ``"silu"`` (``silu(gate) * up``) or ``"clamped_swiglu"`` (gpt-oss:
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``);
* ``bias``: ``w13_bias`` ``[2I]`` (gate biases first, then up) and ``w2_bias`` ``[H]`` after the weights.

w13 rows (dense, MXFP4) / columns (AWQ) hold the gate first, then up in the loader form: gpt-oss's interleaved
``gate_up_proj`` is de-interleaved once when the checkpoint is read. The dense region holds the loader form (the
plain-torch reference computes it); the AWQ region the plain format's kernel layout (the AWQ Triton kernels read
it, bias epilogue added) with the w13 bias interleaved like its columns (gate j, up j).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.custom_op import custom_op
from moeflow.kernels.experts.configs import decode_stage_configs, encode_stage_configs
from moeflow.kernels.formats.awq import AWQFormat
from moeflow.kernels.formats.dense import DenseFormat
from moeflow.kernels.formats.layout import ExpertFormat, ExpertPool
from moeflow.kernels.formats.plain_layout import from_kernel_layout, to_kernel_layout

if TYPE_CHECKING:
    from moeflow.kernels.experts.capturable import StaticWeights
    from moeflow.kernels.experts.ops import Alloc
    from moeflow.kernels.formats.layout import ReferenceWeights

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class BiasedExpertFormat(ExpertFormat):
    """An expert format with biases and a gate activation (abstract: :class:`BiasedDenseFormat`,
    :class:`BiasedAWQFormat`, :class:`~moeflow.kernels.formats.mxfp4.MXFP4Format`)."""

    activation: str = "silu"
    bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    has_triton: ClassVar[bool] = False  # :meth:`triton_forward` exists (else the plain-torch reference computes it)
    capturable: ClassVar[bool] = True  # its Triton kernels over alloc's buffers, or the static torch form
    kinds: ClassVar[dict[str, type[BiasedExpertFormat]]] = {}  # storage name -> class, for the custom op

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            BiasedExpertFormat.kinds[cls.kind] = cls

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not one of {ACTIVATIONS}")
        super().__post_init__()

    def weight_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The region's weight tensors (the biases follow them)."""
        raise NotImplementedError(f"{type(self).__name__}.weight_shapes")

    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        shapes = self.weight_shapes()
        if self.bias:
            H, I = self.hidden_size, self.intermediate_size  # noqa: E741
            shapes += [("w13_bias", self.dtype, (2 * I,)), ("w2_bias", self.dtype, (H,))]
        return shapes

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        return {spec.name: spec.shape for spec in self.specs}

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's loader-form tensors into its region ``uint8 [nbytes]`` (checked)."""
        views = self.views(region.view(1, -1))
        for name, shape in self.loader_shapes().items():
            if name not in tensors:
                raise KeyError(f"missing expert tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"expert tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            dtype = self.spec(name).dtype
            if dtype in (torch.int32, torch.uint8) and t.dtype != dtype:
                raise ValueError(f"expert tensor {name!r} must be {dtype}, got {t.dtype}")
            views[name][0].copy_(self.to_region(name, t.to(dtype)))

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self.views(region.view(1, -1))
        return {spec.name: self.from_region(spec.name, views[spec.name][0]) for spec in self.specs}

    def to_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """One loader-form tensor in the region's layout (default: as published)."""
        return t

    def from_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_region` (a copy)."""
        return t.clone()

    def forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend, *,
                config=None, validate=None):  # noqa: D102 (see ExpertFormat.forward)
        return biased_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend,
                                     config=config, validate=validate)

    def triton_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: ExpertPool,
                       slot_of_expert: torch.Tensor, out: torch.Tensor, expert_mask: torch.Tensor | None,
                       config: dict | None, alloc: Alloc | None = None) -> torch.Tensor:
        """The format's Triton kernels (shapes as :meth:`forward`); only where ``has_triton``. ``alloc``: their
        plan, ``h`` and split-K partials in the caller's persistent buffers (the captured form)."""
        raise NotImplementedError(f"no Triton kernels for {type(self).__name__}")

    def captured_forward(self, pool, x, topk_ids, topk_weights, slot_of_expert, expert_mask, out, backend,
                         alloc):  # noqa: D102 (see ExpertFormat.captured_forward)
        from moeflow.kernels.experts.capturable import static_biased_forward

        if backend == "triton" and self.has_triton:  # the launch config is a function of T: fixed per bucket
            def compute() -> None:
                self.triton_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, None,
                                    alloc=alloc)
            return compute
        weights_of = self.static_weights(pool, alloc)

        def compute_torch() -> None:
            static_biased_forward(x, topk_ids, topk_weights, self, slot_of_expert, expert_mask, out, weights_of)
        return compute_torch

    def static_weights(self, pool: ExpertPool, alloc: Alloc) -> StaticWeights:
        """The device-only dequantization of a slot the static torch form computes with (its constants made
        now, in ``alloc``'s buffers)."""
        raise NotImplementedError(f"{type(self).__name__}.static_weights")

    def cpu_pool_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         pool: ExpertPool, slot_of_expert: torch.Tensor, out: torch.Tensor,
                         expert_mask: torch.Tensor | None) -> None:
        """The op's backend "cpu": a CPU pool computed by a native CPU kernel (MXFP4's ``cpu_kernels``)."""
        raise ValueError(f"{type(self).__name__} experts have no native CPU pool kernel (backend 'cpu')")


@dataclass(frozen=True)
class BiasedDenseFormat(BiasedExpertFormat):
    """Dense weights as published (``w13`` ``[2I, H]`` gate rows first, ``w2`` ``[H, I]``) plus the biases."""

    kind: ClassVar[str] = "dense"
    w13_halves: ClassVar[bool] = True

    def weight_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, self.dtype, shape) for name, shape in DenseFormat.loader_shapes(self).items()]

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        t = pool.tensors
        b13, b2 = (t["w13_bias"][slot].float(), t["w2_bias"][slot].float()) if self.bias else (None, None)
        return t["w13"][slot].float(), b13, t["w2"][slot].float(), b2

    def dense_in(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype

    def static_weights(self, pool: ExpertPool, alloc: Alloc) -> StaticWeights:
        t = pool.tensors

        def weights_of(slot: torch.Tensor):  # as stored: nn.Linear in their dtype, or made fp32 by the forward
            w13, w2 = t["w13"].index_select(0, slot)[0], t["w2"].index_select(0, slot)[0]
            b13 = t["w13_bias"].index_select(0, slot)[0] if self.bias else None
            b2 = t["w2_bias"].index_select(0, slot)[0] if self.bias else None
            return w13, b13, w2, b2
        return weights_of

    def cpu_unsupported(self) -> str | None:
        return f"the experts are {self.kind!r}, not AWQ 4-bit or MXFP4"


@dataclass(frozen=True)
class BiasedAWQFormat(BiasedExpertFormat):
    """AWQ experts in the plain kernel layout plus the biases (loader form: AWQ as published plus the biases)."""

    kind: ClassVar[str] = "awq"
    has_triton: ClassVar[bool] = True

    def weight_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return AWQFormat.region_shapes(self)

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = AWQFormat.loader_shapes(self)
        if self.bias:
            shapes.update(w13_bias=(2 * self.intermediate_size,), w2_bias=(self.hidden_size,))
        return shapes

    def to_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "w13_bias":
            return torch.stack(t.chunk(2), dim=1).flatten()
        if name != "w2_bias":
            return to_kernel_layout(name, t, self.intermediate_size, self.group_size)
        return t

    def from_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "w13_bias":
            return torch.cat([t[0::2], t[1::2]])
        if name != "w2_bias":
            return from_kernel_layout(name, t, self.intermediate_size)
        return t.clone()

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        from moeflow.quant.awq import dequantize

        g, t = self.group_size, self.loader_tensors(pool.buffer[slot])
        w13 = dequantize(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"].float(), g).T
        w2 = dequantize(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"].float(), g).T
        b13, b2 = (t["w13_bias"].float(), t["w2_bias"].float()) if self.bias else (None, None)
        return w13, b13, w2, b2

    def triton_forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config, alloc=None):
        from moeflow.kernels.experts.biased import biased_awq_forward

        return biased_awq_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config=config,
                                  alloc=alloc)

    def static_weights(self, pool: ExpertPool, alloc: Alloc) -> StaticWeights:
        from moeflow.kernels.experts.capturable import awq_static_weights, nibble_shifts

        shifts = alloc("nibble_shifts", (8,), torch.int32, pool.device)
        shifts.copy_(nibble_shifts(pool.device))
        return awq_static_weights(pool, shifts)

    def cpu_unsupported(self) -> str | None:
        return f"the AWQ experts carry biases or the {self.activation!r} activation (gpt-oss)"


@functools.lru_cache(maxsize=64)
def _biased_format(hidden: int, inter: int, kind: str, dtype: torch.dtype, group: int | None, activation: str,
                   bias: bool, alpha: float, limit: float) -> BiasedExpertFormat:
    cls = BiasedExpertFormat.kinds.get(kind)
    if cls is None:
        known = sorted(BiasedExpertFormat.kinds)
        raise ValueError(f"unknown biased expert format kind {kind!r} (expected one of {known})")
    return cls(hidden, inter, dtype, group, activation=activation, bias=bias, swiglu_alpha=alpha, swiglu_limit=limit)


_warned_reference = False


def biased_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None,  # bool [E]
    backend: str,  # resolved: "torch" or "triton"
    *,
    config: dict | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """``expert_forward`` for the biased formats: on backend "triton" their :meth:`~BiasedExpertFormat.triton_forward`
    (MXFP4: :mod:`moeflow.kernels.experts.mxfp4`, AWQ: :func:`moeflow.kernels.experts.biased.biased_awq_forward`);
    dense experts (and backend "torch") through
    the plain-torch reference. Runs as the custom op ``torch.ops.moeflow.biased_expert_forward`` so
    ``torch.compile(fullgraph=True)`` traces through."""
    from moeflow.kernels.experts.checks import check_ids_and_slots, values_checked

    global _warned_reference
    if values_checked(validate, topk_ids):
        check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)
    if topk_ids.numel() == 0:
        return out
    fmt = pool.fmt
    if backend == "triton" and not fmt.has_triton and not _warned_reference:
        _warned_reference = True
        warnings.warn(f"no Triton kernel for {fmt.kind} experts with biases/{fmt.activation}: "
                      "computing them with the plain-torch reference", stacklevel=2)
    flat_cfg = encode_stage_configs(config)
    _biased_expert_forward_op(x, topk_ids, topk_weights, pool.buffer, slot_of_expert, expert_mask,
                              fmt.hidden_size, fmt.intermediate_size, fmt.kind, fmt.dtype, fmt.group_size or 0,
                              fmt.activation, fmt.bias, fmt.swiglu_alpha, fmt.swiglu_limit, flat_cfg, backend, out)
    return out




@custom_op("moeflow::biased_expert_forward", mutates_args=("out",))
def _biased_expert_forward_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, buffer: torch.Tensor,
    slot_of_expert: torch.Tensor, expert_mask: torch.Tensor | None, hidden: int, inter: int, kind: str,
    dtype: torch.dtype, group: int, activation: str, bias: bool, alpha: float, limit: float, config: list[int],
    backend: str, out: torch.Tensor,
) -> None:
    """out[pairs of selected experts] = weighted expert outputs; the pool is ``buffer`` uint8 [S, nbytes]."""
    fmt = _biased_format(hidden, inter, kind, dtype, group or None, activation, bias, alpha, limit)
    pool = ExpertPool(fmt, buffer)
    if backend == "cpu":  # MXFP4Format.cpu_kernels: the native CPU kernel on the slots' bytes
        fmt.cpu_pool_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)
        return
    if backend == "triton" and fmt.has_triton:
        cfg = decode_stage_configs(config)
        fmt.triton_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, cfg)
        return
    from moeflow.kernels.experts.biased import biased_expert_forward_reference

    biased_expert_forward_reference(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)


@_biased_expert_forward_op.register_fake
def _(x, topk_ids, topk_weights, buffer, slot_of_expert, expert_mask, hidden, inter, kind, dtype, group, activation,
      bias, alpha, limit, config, backend, out):
    return None
