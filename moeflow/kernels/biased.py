"""Experts with projection biases and a chosen gate activation (gpt-oss), stored dense, AWQ or MXFP4.

:class:`BiasedExpertFormat` extends :class:`~moeflow.kernels.pool.ExpertFormat` (same byte-region contract:
one expert = one contiguous region, host region and device slot byte-identical) with

* ``activation``: ``"silu"`` (``silu(gate) * up``) or ``"clamped_swiglu"`` (gpt-oss:
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``);
* ``bias``: ``w13_bias`` ``[2I]`` (gate biases first, then up) and ``w2_bias`` ``[H]`` after the weights;
* the storage ``kind`` ``"mxfp4"`` besides ``"dense"`` / ``"awq"``; ``dtype`` is then the bias dtype. Loader form
  as published (:mod:`moeflow.kernels.mxfp4_reference`): ``w13_blocks`` uint8 ``[2I, H/32, 16]``, ``w13_scales``
  uint8 ``[2I, H/32]``, ``w2_blocks`` ``[H, I/32, 16]``, ``w2_scales`` ``[H, I/32]``. The region holds them in K
  panels (:meth:`BiasedExpertFormat.mxfp4_panels`: ``P13``, ``P2`` = 64 at gpt-oss's sizes): ``w13_blocks``
  ``[H/P13, 2I, P13/32, 16]``, ``w13_scales`` ``[H/P13, 2I, P13/32]``, ``w2_*`` likewise with ``I/P2`` panels of
  ``H`` rows, so the rows of a kernel tile in one panel are one contiguous range (the same bytes per expert); the
  blocks' bits are permuted within each 32-bit word
  (:func:`~moeflow.kernels.mxfp4_reference.to_kernel_layout`). Converted in :meth:`BiasedExpertFormat.write`,
  inverted exactly by :meth:`BiasedExpertFormat.loader_tensors`.

w13 rows (dense, MXFP4) / columns (AWQ) hold the gate first, then up: gpt-oss's interleaved ``gate_up_proj``
is de-interleaved once when the checkpoint is read. ``moeflow.kernels.expert_forward`` hands pools of this
format to :func:`biased_expert_forward` (``fmt.extended``).

Numerics (as the plain format's reference): GEMMs accumulate in fp32, the bias is added in fp32, the
activation is computed in fp32 and stored in the activation dtype; w2 + bias is multiplied by the fp32
routing weight and stored in the activation dtype. Dense weights in the activation dtype use ``F.linear``
(``nn.Linear`` semantics, as transformers computes them).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from moeflow.kernels.checks import check_ids_and_slots, values_checked
from moeflow.kernels.mxfp4_reference import (
    BLOCK,
    dequantize_mxfp4,
    from_kernel_layout,
    from_panels,
    panel_for,
    to_kernel_layout,
    to_panels,
)
from moeflow.kernels.pool import ALIGN, ExpertFormat, ExpertPool, TensorSpec
from moeflow.kernels.pool import from_kernel_layout as pool_from_kernel_layout
from moeflow.kernels.pool import to_kernel_layout as pool_to_kernel_layout
from moeflow.quant.awq import dequantize

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class BiasedExpertFormat(ExpertFormat):
    """An :class:`ExpertFormat` with biases, a gate activation and the MXFP4 storage kind (see the module doc)."""

    activation: str = "silu"
    bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    extended: ClassVar[bool] = True  # moeflow.kernels.expert_forward computes it through this module

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not one of {ACTIVATIONS}")
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        if self.kind == "mxfp4":
            if H % BLOCK or I % BLOCK:
                raise ValueError(f"MXFP4 experts need hidden ({H}) and intermediate ({I}) sizes divisible by {BLOCK}")
            p13, p2 = self.mxfp4_panels
            shapes = [("w13_blocks", torch.uint8, (H // p13, 2 * I, p13 // BLOCK, BLOCK // 2)),
                      ("w13_scales", torch.uint8, (H // p13, 2 * I, p13 // BLOCK)),
                      ("w2_blocks", torch.uint8, (I // p2, H, p2 // BLOCK, BLOCK // 2)),
                      ("w2_scales", torch.uint8, (I // p2, H, p2 // BLOCK))]
            specs, offset = [], 0
        elif self.kind == "awq":  # the plain format's checks and kernel layout (the AWQ Triton kernels read it)
            super().__post_init__()
            shapes = [(spec.name, spec.dtype, spec.shape) for spec in self.specs]
            specs, offset = [], 0
        else:  # dense: the loader form (nn.Linear), computed by the plain-torch reference
            super().__post_init__()
            shapes = [(name, self.dtype, shape) for name, shape in ExpertFormat.loader_shapes(self).items()]
            specs, offset = [], 0
        if self.bias:
            shapes += [("w13_bias", self.dtype, (2 * I,)), ("w2_bias", self.dtype, (H,))]
        for name, dtype, shape in shapes:
            spec = TensorSpec(name, dtype, shape, offset)
            specs.append(spec)
            offset = -(-(offset + spec.nbytes) // ALIGN) * ALIGN  # each tensor ALIGN-aligned, as the plain format
        object.__setattr__(self, "specs", tuple(specs))
        object.__setattr__(self, "nbytes", offset)

    @property
    def mxfp4_panels(self) -> tuple[int, int]:
        """K per panel of the MXFP4 region's (w13, w2) matrices (module doc; K = H for w13, I for w2)."""
        return panel_for(self.hidden_size), panel_for(self.intermediate_size)

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        """The loader form: AWQ as published plus the biases for kind "awq", MXFP4 as published (row-major
        ``[N, K/32, 16]`` / ``[N, K/32]``) plus the biases, else exactly the region's tensors."""
        if self.kind == "mxfp4":
            return {spec.name: _row_major(spec.shape) if spec.name[-7:] in ("_blocks", "_scales") else spec.shape
                    for spec in self.specs}
        if self.kind != "awq":
            return {spec.name: spec.shape for spec in self.specs}
        shapes = ExpertFormat.loader_shapes(self)
        if self.bias:
            shapes.update(w13_bias=(2 * self.intermediate_size,), w2_bias=(self.hidden_size,))
        return shapes

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's loader-form tensors into its region ``uint8 [nbytes]`` (checked): MXFP4 blocks
        to their kernel layout and blocks and scales into K panels, AWQ tensors to the plain format's kernel
        layout and the w13 bias interleaved like its columns (gate j, up j); everything else copied."""
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
            views[name][0].copy_(self._to_region(name, t.to(dtype)))

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Exact inverse of :meth:`write`."""
        views = self.views(region.view(1, -1))
        return {spec.name: self._from_region(spec.name, views[spec.name][0]) for spec in self.specs}

    def _to_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "mxfp4" and name[-7:] in ("_blocks", "_scales"):
            panel = self.mxfp4_panels[0 if name.startswith("w13") else 1]
            return to_panels(to_kernel_layout(t) if name.endswith("_blocks") else t, panel)
        if self.kind == "awq" and name == "w13_bias":
            return torch.stack(t.chunk(2), dim=1).flatten()
        if self.kind == "awq" and name != "w2_bias":
            return pool_to_kernel_layout(name, t, self.intermediate_size, self.group_size)
        return t

    def _from_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "mxfp4" and name.endswith("_blocks"):
            return from_kernel_layout(from_panels(t))
        if self.kind == "mxfp4" and name.endswith("_scales"):
            return from_panels(t).clone(memory_format=torch.contiguous_format)
        if self.kind == "awq" and name == "w13_bias":
            return torch.cat([t[0::2], t[1::2]])
        if self.kind == "awq" and name != "w2_bias":
            return pool_from_kernel_layout(name, t, self.intermediate_size)
        return t.clone()


def _row_major(panel_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Region shape ``(K/P, N, P/32, ...)`` -> the published ``(N, K/32, ...)``."""
    n_panels, rows, per_panel, *rest = panel_shape
    return (rows, n_panels * per_panel, *rest)


def is_extended(fmt: ExpertFormat) -> bool:
    return bool(getattr(fmt, "extended", False))


def gate_activation(h: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """h fp32 [P, 2I] (gate columns first, then up) -> a fp32 [P, I]."""
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter], h[..., inter:]
    if getattr(fmt, "activation", "silu") == "silu":
        return F.silu(gate) * up
    limit, alpha = fmt.swiglu_limit, fmt.swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def slot_weights(pool: ExpertPool, slot: int) -> Weights:
    """fp32 (W13 [2I, H], b13 [2I] or None, W2 [H, I], b2 [H] or None) of one slot, ``nn.Linear`` orientation."""
    t, fmt = pool.tensors, pool.fmt
    if fmt.kind == "dense":
        w13, w2 = t["w13"][slot].float(), t["w2"][slot].float()
    elif fmt.kind == "awq":  # from the region's kernel layout back to AWQ as published
        g, t = fmt.group_size, fmt.loader_tensors(pool.buffer[slot])
        w13 = dequantize(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"].float(), g).T
        w2 = dequantize(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"].float(), g).T
        b13, b2 = (t["w13_bias"].float(), t["w2_bias"].float()) if fmt.bias else (None, None)
        return w13, b13, w2, b2
    else:  # MXFP4: the region's panels back to row-major blocks as published
        w13, w2 = (dequantize_mxfp4(from_kernel_layout(from_panels(t[f"{m}_blocks"][slot])),
                                    from_panels(t[f"{m}_scales"][slot])) for m in ("w13", "w2"))
    has_bias = getattr(fmt, "bias", False)
    b13 = t["w13_bias"][slot].float() if has_bias else None
    b2 = t["w2_bias"][slot].float() if has_bias else None
    return w13, b13, w2, b2


def biased_expert_forward_reference(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H], written for the pairs of selected experts only
    expert_mask: torch.Tensor | None = None,  # bool [E]
) -> torch.Tensor:
    """The plain-torch compute of a :class:`BiasedExpertFormat` pool (the contract of ``expert_forward``)."""
    fmt = pool.fmt
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    t = pool.tensors
    same_dtype_dense = fmt.kind == "dense" and x.dtype == fmt.dtype
    for e in torch.unique(flat_ids).tolist():
        if expert_mask is not None and not bool(expert_mask[e]):
            continue
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        rows = x[pairs // k]
        s = int(slot_of_expert[e])
        if same_dtype_dense:  # nn.Linear semantics in the activation dtype, like the transformers model
            b13 = t["w13_bias"][s] if fmt.bias else None
            b2 = t["w2_bias"][s] if fmt.bias else None
            a = gate_activation(F.linear(rows, t["w13"][s], b13).float(), fmt).to(x.dtype)
            y = F.linear(a, t["w2"][s], b2) * flat_w[pairs, None].to(x.dtype)
        else:
            w13, b13, w2, b2 = slot_weights(pool, s)
            h = rows.float() @ w13.T
            a = gate_activation(h if b13 is None else h + b13, fmt).to(x.dtype)
            y = a.float() @ w2.T
            y = (y if b2 is None else y + b2) * flat_w[pairs, None]
        out[pairs] = y.to(out.dtype)
    return out


def biased_awq_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # a BiasedExpertFormat pool of kind "awq" (the plain format's kernel layout + biases)
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None = None,  # bool [E]
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Biased AWQ experts through the grouped AWQ Triton kernels: plan, w13 with ``+ bias`` and the format's
    activation in the epilogue, w2 with ``+ bias`` times the routing weight (``config``: ``{"BLOCK_M", "w13":
    {...}, "w2": {...}}`` overriding the heuristic defaults, ``SPLIT_K`` included: the in-kernel fixup sums the
    splits and adds the bias once, after the sum)."""
    from moeflow.kernels import configs
    from moeflow.kernels.ops import routing_plan
    from moeflow.kernels.triton_experts import expert_gemm

    fmt, t = pool.fmt, pool.tensors
    T, top_k = topk_ids.shape
    num_pairs, num_experts = T * top_k, slot_of_expert.shape[0]
    g, inter = fmt.group_size, fmt.intermediate_size
    cfg = configs.default_config("moe", T, num_experts, top_k, inter, fmt.hidden_size, g)
    config = config or {}
    block_m = int(config.get("BLOCK_M", cfg["BLOCK_M"]))
    stage = {name: {**cfg[name], **config.get(name, {}), "BLOCK_M": block_m} for name in ("w13", "w2")}
    sorted_ids, expert_of_block, _ = routing_plan(topk_ids, num_experts, block_m, "triton")
    act = dict(activation=fmt.activation, alpha=fmt.swiglu_alpha, limit=fmt.swiglu_limit)
    h = x.new_empty((num_pairs, inter))
    expert_gemm(0, x, (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]), h, sorted_ids, expert_of_block,
                slot_of_expert, expert_mask, None, num_pairs, top_k, g, stage["w13"],
                bias=t["w13_bias"] if fmt.bias else None, **act)
    w = topk_weights.reshape(-1).float().contiguous()
    expert_gemm(1, h, (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"]), out, sorted_ids, expert_of_block,
                slot_of_expert, expert_mask, w, num_pairs, 1, g, stage["w2"], bias=t["w2_bias"] if fmt.bias else None)
    return out


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
    """``expert_forward`` for extended formats: on backend "triton" MXFP4 through :mod:`moeflow.kernels.mxfp4` and
    AWQ through the grouped AWQ kernels (:func:`biased_awq_forward`); dense experts (and backend "torch") through
    the plain-torch reference. Runs as the
    custom op ``torch.ops.moeflow.biased_expert_forward`` so ``torch.compile(fullgraph=True)`` traces through."""
    global _warned_reference
    if values_checked(validate, topk_ids):
        check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)
    if topk_ids.numel() == 0:
        return out
    fmt = pool.fmt
    if backend == "triton" and fmt.kind == "dense" and not _warned_reference:
        _warned_reference = True
        warnings.warn(f"no Triton kernel for {fmt.kind} experts with biases/{fmt.activation}: "
                      "computing them with the plain-torch reference", stacklevel=2)
    flat_cfg = [] if config is None else [int(config.get("BLOCK_M", 0))] + [
        int(config.get(stage, {}).get(key, -1)) for stage in ("w13", "w2") for key in _STAGE_KEYS]
    _biased_expert_forward_op(x, topk_ids, topk_weights, pool.buffer, slot_of_expert, expert_mask,
                              fmt.hidden_size, fmt.intermediate_size, fmt.kind, fmt.dtype, fmt.group_size or 0,
                              fmt.activation, fmt.bias, fmt.swiglu_alpha, fmt.swiglu_limit, flat_cfg, backend, out)
    return out


_STAGE_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


@functools.lru_cache(maxsize=64)
def _format(hidden: int, inter: int, kind: str, dtype: torch.dtype, group: int, activation: str, bias: bool,
            alpha: float, limit: float) -> BiasedExpertFormat:
    return BiasedExpertFormat(hidden, inter, kind, dtype, group or None, activation=activation, bias=bias,
                              swiglu_alpha=alpha, swiglu_limit=limit)


@torch.library.custom_op("moeflow::biased_expert_forward", mutates_args=("out",))
def _biased_expert_forward_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, buffer: torch.Tensor,
    slot_of_expert: torch.Tensor, expert_mask: torch.Tensor | None, hidden: int, inter: int, kind: str,
    dtype: torch.dtype, group: int, activation: str, bias: bool, alpha: float, limit: float, config: list[int],
    backend: str, out: torch.Tensor,
) -> None:
    """out[pairs of selected experts] = weighted expert outputs; the pool is ``buffer`` uint8 [S, nbytes]."""
    pool = ExpertPool(_format(hidden, inter, kind, dtype, group, activation, bias, alpha, limit), buffer)
    if backend == "triton" and kind in ("mxfp4", "awq"):
        cfg = None
        if config:
            n = len(_STAGE_KEYS)
            stages = {name: {k: v for k, v in zip(_STAGE_KEYS, config[1 + i * n: 1 + (i + 1) * n], strict=True)
                             if v >= 0} for i, name in enumerate(("w13", "w2"))}
            cfg = {**({"BLOCK_M": config[0]} if config[0] > 0 else {}), **stages}
        if kind == "awq":
            biased_awq_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config=cfg)
            return
        from moeflow.kernels.mxfp4 import mxfp4_expert_forward

        mxfp4_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config=cfg)
        return
    biased_expert_forward_reference(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)


@_biased_expert_forward_op.register_fake
def _(x, topk_ids, topk_weights, buffer, slot_of_expert, expert_mask, hidden, inter, kind, dtype, group, activation,
      bias, alpha, limit, config, backend, out):
    return None
