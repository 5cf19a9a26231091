"""Expert compute: routing plan, grouped expert GEMMs reading a slot pool, the combine, and an AWQ linear.

``backend`` selects the implementation: ``"torch"`` (the reference in :mod:`.reference`), ``"triton"``
(Triton kernels; on a CPU they run under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA, torch
otherwise). Every path goes through the ``torch.ops.moeflow`` custom ops of :mod:`.ops`, so
``torch.compile(fullgraph=True)`` traces it. See ``docs/kernels.md``.
"""

from __future__ import annotations

import torch

from moeflow.kernels import ops
from moeflow.kernels.checks import (
    check_awq_weights,
    check_expert_args,
    check_float,
    check_ids_and_slots,
    values_checked,
)
from moeflow.kernels.pool import ExpertFormat, ExpertPool

__all__ = ["ExpertFormat", "ExpertPool", "expert_forward", "combine", "moe_forward", "awq_linear", "resolve_backend"]

BACKENDS = ("torch", "triton", "auto")


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; checks the name."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _pool_weights(pool: ExpertPool) -> tuple[tuple, tuple, int]:
    t, fmt = pool.tensors, pool.fmt
    if fmt.kind == "dense":
        return (t["w13"], None, None), (t["w2"], None, None), 0
    return (
        (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]),
        (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"]),
        fmt.group_size,
    )


def _check_pool(pool: ExpertPool) -> None:
    fmt, t, S = pool.fmt, pool.tensors, pool.n_slots
    H, I = fmt.hidden_size, fmt.intermediate_size  # noqa: E741
    if fmt.kind == "awq":
        check_awq_weights(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], fmt.group_size, H, 2 * I, "pool.w13_", S)
        check_awq_weights(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], fmt.group_size, I, H, "pool.w2_", S)


def expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int32/int64 [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # slots [S, ...]
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H], written in place for the selected pairs only
    expert_mask: torch.Tensor | None = None,  # bool [E]; None = every expert
    backend: str = "torch",
    *,
    config: dict | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Fill ``out`` [T*k, H] with the routing-weighted outputs of the pairs whose expert is selected.

    Rows of unselected experts are not touched, and a selected expert's rows are bitwise the same whichever
    other experts are selected, so a caller may compute a layer in stages (one ``expert_mask`` per stage)
    into one ``out`` and call :func:`combine` once. ``config`` overrides the table lookup
    (``{"BLOCK_M", "w13": {...}, "w2": {...}}``); ``validate`` forces the value checks on or off (they cost
    one device sync; default on, except while ``torch.compile`` traces or a CUDA graph is captured).
    """
    backend = resolve_backend(backend, x.device)
    check_expert_args(x, topk_ids, topk_weights, slot_of_expert, out, expert_mask, pool.fmt.hidden_size)
    if pool.device != x.device:
        raise ValueError(f"pool is on {pool.device} but x is on {x.device}")
    if getattr(pool.fmt, "extended", False):  # biases / clamped SwiGLU / MXFP4 (gpt-oss): moeflow.kernels.biased
        from moeflow.kernels.biased import biased_expert_forward

        return biased_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend,
                                     config=config, validate=validate)
    _check_pool(pool)
    if values_checked(validate, topk_ids):
        check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)
    w13, w2, group = _pool_weights(pool)
    flat_cfg = ops.encode_moe_config(config) if config is not None else []
    ops.expert_forward_op(x, topk_ids, topk_weights, *w13, *w2, slot_of_expert, expert_mask, group, flat_cfg,
                          backend, out)
    return out


def combine(y: torch.Tensor, top_k: int, backend: str = "torch") -> torch.Tensor:
    """[T*k, H] -> [T, H]: sum each token's k expert outputs in fp32, in k order (deterministic, no atomics)."""
    check_float(y, "y", 2)
    if top_k < 1 or y.shape[0] % top_k:
        raise ValueError(f"combine: y has {y.shape[0]} rows, not a multiple of top_k={top_k}")
    return ops.combine_op(y, top_k, resolve_backend(backend, y.device))


def moe_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,  # int32 [E]
    backend: str = "torch",
    *,
    config: dict | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """All experts resident: plan, expert GEMMs and combine in one call. x [T, H] -> [T, H]."""
    out = torch.empty((topk_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, None, backend, config=config,
                   validate=validate)
    return combine(out, topk_ids.shape[1], backend)


def awq_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/g, N/8]
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
    backend: str = "torch",
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Dense W4A16 matmul ``x @ W`` (AWQ GEMM layout), fp32 accumulation, result [M, N] in x's dtype."""
    check_float(x, "x", 2)
    K = x.shape[1]
    if scales.dim() != 2:
        raise ValueError(f"scales must be [K/g, N], got shape {tuple(scales.shape)}")
    check_awq_weights(qweight, qzeros, scales, group_size, K, scales.shape[1], "")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    flat_cfg = ops.encode_linear_config(config) if config is not None else []
    return ops.awq_linear_op(x, qweight, qzeros, scales, group_size, flat_cfg, resolve_backend(backend, x.device))
