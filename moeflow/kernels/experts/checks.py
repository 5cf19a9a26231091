"""Argument checks run before any launch: wrong dtypes, shapes, devices, layouts and out-of-range ids or slots.

Shape, dtype, device and layout checks are free (host metadata). The value checks (expert ids in range,
slots of the experts in use inside the pool) read device memory: one host sync, skipped while
``torch.compile`` traces or a CUDA graph is captured, and skippable with ``validate=False`` on a hot path
whose inputs are valid by construction (ids from ``topk``, slots from the scheduler).
"""

from __future__ import annotations

import os

import torch

from moeflow.kernels.formats.plain_layout import awq_panel
from moeflow.quant.awq import SUPPORTED_GROUP_SIZES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENV_CHECKS = "MOEFLOW_KERNEL_CHECKS"  # "0" turns the value checks off by default


def values_checked(validate: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether to run the value checks (which sync with the device) for this call."""
    if torch.compiler.is_compiling():
        return False
    if validate is not None:
        return validate
    if os.environ.get(ENV_CHECKS, "1") == "0":
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_float(t: torch.Tensor, name: str, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the computation is on {device}")


def check_packed(
    t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | tuple[torch.dtype, ...],
    strided_rows: bool = False,
) -> None:
    """A packed weight tensor: exact shape and dtype, rows contiguous (leading slot dim may have any stride);
    ``strided_rows``: the rows may be further apart than their length (columns of a wider matrix)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    inner = t.shape[-2:]
    gap = inner[0] > 1 and (t.stride(-2) < inner[1] if strided_rows else t.stride(-2) != inner[1])
    if t.numel() and (t.stride(-1) != 1 or gap):
        raise ValueError(f"{name} must be contiguous in its last two dimensions, got strides {t.stride()}")


def check_group_size(group_size: int, k: int, name: str) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: supported AWQ group sizes are {SUPPORTED_GROUP_SIZES}")
    if k % group_size:
        raise ValueError(f"{name}: K={k} is not a multiple of group_size={group_size}")


def check_awq_weights(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, k: int, n: int, prefix: str,
    slots: int | None = None,
) -> None:
    """AWQ tensors of a [k, n] matrix (with a leading slot dim when ``slots`` is given)."""
    lead = () if slots is None else (slots,)
    check_group_size(group_size, k, prefix)
    if n % 8:
        raise ValueError(f"{prefix}: N={n} must be a multiple of 8 for AWQ packing")
    check_packed(qweight, f"{prefix}qweight", lead + (k, n // 8), torch.int32)
    check_packed(qzeros, f"{prefix}qzeros", lead + (k // group_size, n // 8), torch.int32)
    check_packed(scales, f"{prefix}scales", lead + (k // group_size, n), FLOAT_DTYPES)


def check_pool_weights(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, k: int, n: int, prefix: str,
    slots: int, strided_rows: bool = False,
) -> None:
    """AWQ tensors of a [k, n] matrix in the pool's kernel layout (``qweight [S, k/P, n, P/8]``, P =
    ``awq_panel(group_size)``, see ``pool.py``); ``strided_rows``: qweight / qzeros / scales may be column slices
    of a wider matrix (the kernel reads panels and rows by stride)."""
    check_group_size(group_size, k, prefix)
    p = awq_panel(group_size)
    check_packed(qweight, f"{prefix}qweight", (slots, k // p, n, p // 8), torch.int32, strided_rows)
    check_packed(qzeros, f"{prefix}qzeros", (slots, k // group_size, n // 8), torch.int32, strided_rows)
    check_packed(scales, f"{prefix}scales", (slots, k // group_size, n), FLOAT_DTYPES, strided_rows)


def check_ids_and_slots(
    topk_ids: torch.Tensor,  # int [T, k]
    slot_of_expert: torch.Tensor,  # int32 [E]
    expert_mask: torch.Tensor | None,  # bool [E]
    n_slots: int,
) -> None:
    """Expert ids in [0, E) and, for every expert used and selected, a slot in [0, n_slots). One host sync."""
    E = slot_of_expert.shape[0]
    if topk_ids.numel() == 0:
        return
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids_bad = (ids < 0) | (ids >= E)
    used = torch.zeros(E, dtype=torch.bool, device=ids.device)
    used[ids.clamp(0, max(E - 1, 0))] = True
    if expert_mask is not None:
        used &= expert_mask
    slots = slot_of_expert.to(torch.int64)
    slot_bad = used & ((slots < 0) | (slots >= n_slots))
    n_ids_bad, n_slot_bad = torch.stack([ids_bad.sum(), slot_bad.sum()]).tolist()
    if n_ids_bad:
        bad = ids[ids_bad][:5].tolist()
        raise ValueError(
            f"topk_ids: {n_ids_bad} expert ids outside [0, {E}) (num_experts from slot_of_expert), e.g. {bad}"
        )
    if n_slot_bad:
        experts = torch.nonzero(slot_bad).squeeze(1)[:5]
        pairs = list(zip(experts.tolist(), slots[experts].tolist(), strict=False))
        raise ValueError(
            f"slot_of_expert points outside the pool of {n_slots} slots for experts in use: (expert, slot) {pairs}"
        )


def check_expert_args(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # float [T, k]
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor | None,  # [T*k, H]
    expert_mask: torch.Tensor | None,  # bool [E]
    hidden: int,
) -> None:
    check_float(x, "x", 2)
    if x.shape[1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[1]} but the expert pool has {hidden}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens")
    if not topk_weights.is_floating_point() or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights must be float with the shape of topk_ids {tuple(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    if slot_of_expert.dtype != torch.int32 or slot_of_expert.dim() != 1:
        raise ValueError(f"slot_of_expert must be int32 [E], got {slot_of_expert.dtype} {tuple(slot_of_expert.shape)}")
    if slot_of_expert.shape[0] < 1:
        raise ValueError("slot_of_expert must name at least one expert")
    if out is not None:
        want = (topk_ids.numel(), hidden)
        if tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"out must be {x.dtype} {want}, got {out.dtype} {tuple(out.shape)}")
        if out.numel() and out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dimension, got strides {out.stride()}")
    if expert_mask is not None:
        if expert_mask.dtype != torch.bool or tuple(expert_mask.shape) != tuple(slot_of_expert.shape):
            raise ValueError(
                f"expert_mask must be bool [{slot_of_expert.shape[0]}], "
                f"got {expert_mask.dtype} {tuple(expert_mask.shape)}"
            )
    check_same_device(
        x.device, topk_ids=topk_ids, topk_weights=topk_weights, slot_of_expert=slot_of_expert, out=out,
        expert_mask=expert_mask,
    )
