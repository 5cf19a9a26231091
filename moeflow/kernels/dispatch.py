"""The kernels' entry points (re-exported by :mod:`moeflow.kernels`): routing, grouped expert GEMMs reading a
slot pool, the combine, and an AWQ linear.

``backend`` selects the implementation: ``"torch"`` (the reference in :mod:`.reference`), ``"triton"``
(Triton kernels; on a CPU they run under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA, torch
otherwise). In eager mode the Triton path calls the kernels' launchers directly (configs resolved once per T
bucket and cached, intermediates in persistent scratch buffers); while ``torch.compile`` traces, every path
goes through the ``torch.ops.moeflow`` custom ops of :mod:`.ops` instead. See ``docs/kernels.md``.
"""

from __future__ import annotations

import torch

from moeflow.kernels import workspace
from moeflow.kernels.experts import ops
from moeflow.kernels.experts.checks import (
    check_awq_weights,
    check_expert_args,
    check_float,
    check_ids_and_slots,
    check_pool_weights,
    check_same_device,
    values_checked,
)
from moeflow.kernels.experts.reference import pool_weights
from moeflow.kernels.pool import ExpertPool

BACKENDS = ("torch", "triton", "auto")
CPU_INT4 = "cpu-int4"  # the model-level choice of the CPU int4 kernels (engine/build.resolve_kernels)


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether the kernel choice ``backend`` (any of :data:`BACKENDS` or :data:`CPU_INT4`) runs the Triton kernels
    on ``device``: the one place callers learn it (instead of comparing names)."""
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def uses_cpu_int4(backend: str) -> bool:
    """Whether the kernel choice ``backend`` is the CPU int4 kernels (torch's / moeflow's native q4 form)."""
    return backend == CPU_INT4


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; checks the name."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _check_pool(pool: ExpertPool) -> None:
    """Shapes, dtypes and layout of the pool's views: checked on first use only (views are fixed)."""
    compiling = torch.compiler.is_compiling()  # no flag read or write while tracing: it would guard / recompile
    if not compiling and pool.checked:
        return
    pool.fmt.check_pool(pool)
    if not compiling:
        pool.checked = True


def _eager() -> bool:
    """The direct-launch path: not while torch.compile traces (it needs the custom ops)."""
    return not torch.compiler.is_compiling()


def _moe_config(x: torch.Tensor, pool: ExpertPool, num_experts: int, top_k: int, config: dict | None) -> dict:
    if config is not None:
        return ops.decode_moe_config(ops.encode_moe_config(config))
    w13, _, group = pool_weights(pool)
    return ops.resolve_moe_config(x, num_experts, top_k, w13[1], group, pool.fmt.intermediate_size)


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
    return pool.fmt.forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask,
                            resolve_backend(backend, x.device), config=config, validate=validate)


def plain_expert_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # int32/int64 [T, k]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    pool: ExpertPool,  # slots [S, ...] of a PlainFormat (dense or AWQ)
    slot_of_expert: torch.Tensor,  # int32 [E]
    out: torch.Tensor,  # [T*k, H]
    expert_mask: torch.Tensor | None,  # bool [E]
    backend: str,  # resolved: "torch" or "triton"
    *,
    config: dict | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """:func:`expert_forward` of the plain formats (``PlainFormat.forward``): the grouped Triton kernels or the
    plain-torch reference."""
    _check_call(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, validate)
    w13, w2, group = pool_weights(pool)
    if backend == "triton" and _eager():
        if topk_ids.numel():
            ops.check_triton_device(x)
            cfg = _moe_config(x, pool, slot_of_expert.shape[0], topk_ids.shape[1], config)
            plan = ops.plan_eager(topk_ids, slot_of_expert.shape[0], cfg["BLOCK_M"], workspace.scratch)
            ops.experts_eager(x, plan, topk_weights, w13, w2, slot_of_expert, expert_mask, group, cfg, out,
                              workspace.scratch)
        return out
    flat_cfg = ops.encode_moe_config(config) if config is not None else []
    ops.expert_forward_op(x, topk_ids, topk_weights, *w13, *w2, slot_of_expert, expert_mask, group, flat_cfg,
                          backend, out)
    return out


def _check_call(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, validate) -> None:
    check_expert_args(x, topk_ids, topk_weights, slot_of_expert, out, expert_mask, pool.fmt.hidden_size)
    if pool.device != x.device:
        raise ValueError(f"pool is on {pool.device} but x is on {x.device}")
    _check_pool(pool)
    if values_checked(validate, topk_ids):
        check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)


def combine(y: torch.Tensor, top_k: int, backend: str = "torch") -> torch.Tensor:
    """[T*k, H] -> [T, H]: sum each token's k expert outputs in fp32, in k order (deterministic, no atomics)."""
    check_float(y, "y", 2)
    if top_k < 1 or y.shape[0] % top_k:
        raise ValueError(f"combine: y has {y.shape[0]} rows, not a multiple of top_k={top_k}")
    backend = resolve_backend(backend, y.device)
    if backend == "triton" and _eager() and y.numel():
        ops.check_triton_device(y)
        return ops.combine_eager(y, top_k, y.new_empty((y.shape[0] // top_k, y.shape[1])))
    return ops.combine_op(y, top_k, backend)


def route(
    logits: torch.Tensor,  # [T, E] router logits, or x [T, H] when ``gate`` is given
    top_k: int,
    backend: str = "torch",
    *,
    renormalize: bool = True,
    gate: torch.Tensor | None = None,  # [E, H] router weight (nn.Linear layout)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router in one launch: (topk_ids int32 [T, k], topk_weights fp32 [T, k]) from the logits
    (softmax in fp32, top-k, renormalised). :func:`moe_forward` with ``router_logits`` fuses it into the plan."""
    check_float(logits, "logits", 2)
    E = gate.shape[0] if gate is not None else logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, {E}] (number of experts)")
    if gate is not None and (gate.dim() != 2 or gate.shape[1] != logits.shape[1]):
        raise ValueError(f"gate must be [E, {logits.shape[1]}], got {tuple(gate.shape)}")
    return ops.route_op(logits, top_k, renormalize, gate, resolve_backend(backend, logits.device))


def moe_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor | None,  # int [T, k]; None with ``router_logits``
    topk_weights: torch.Tensor | None,  # fp32 [T, k]; None with ``router_logits``
    pool: ExpertPool,
    slot_of_expert: torch.Tensor,  # int32 [E]
    backend: str = "torch",
    *,
    config: dict | None = None,
    validate: bool | None = None,
    router_logits: torch.Tensor | None = None,  # [T, E]: route inside the plan launch (Mixtral's router)
    top_k: int | None = None,  # with router_logits
    renormalize: bool = True,
    return_routing: bool = False,  # also return (topk_ids int32 [T, k], topk_weights fp32 [T, k])
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All experts resident: plan, expert GEMMs and combine in one call. x [T, H] -> [T, H].

    Eager Triton at decode is 4 launches: route + sentinel fill + plan, w13, w2, combine (+ w2 split-K sum).
    ``return_routing`` hands back the routing too (what a trace or a predictor records).
    """
    backend = resolve_backend(backend, x.device)
    # the fused eager launches know the plain formats; biased / MXFP4 experts go through expert_forward's hook
    fused = backend == "triton" and _eager() and pool.fmt.fused_moe
    if router_logits is not None:
        if top_k is None:
            raise ValueError("moe_forward: router_logits needs top_k")
        if not fused:
            topk_ids, topk_weights = route(router_logits, top_k, backend, renormalize=renormalize)
    elif topk_ids is None or topk_weights is None:
        raise ValueError("moe_forward: pass topk_ids and topk_weights, or router_logits and top_k")
    if fused:
        y, ids, wts = _moe_forward_eager(x, topk_ids, topk_weights, pool, slot_of_expert, config, validate,
                                         router_logits, top_k, renormalize)
        if not return_routing:
            return y
        T, k = x.shape[0], top_k if router_logits is not None else topk_ids.shape[1]
        return y, ids.reshape(T, k).to(torch.int32, copy=True), wts.reshape(T, k).to(torch.float32, copy=True)
    out = torch.empty((topk_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, None, backend, config=config,
                   validate=validate)
    y = combine(out, topk_ids.shape[1], backend)
    return (y, topk_ids.to(torch.int32), topk_weights.float()) if return_routing else y


def _moe_forward_eager(x, topk_ids, topk_weights, pool, slot_of_expert, config, validate, router_logits, top_k,
                       renormalize) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, H], flat ids int32 [T*k], weights [T, k] or flat fp32 [T*k]); ids/weights may be scratch views."""
    E = slot_of_expert.shape[0]
    T, H = x.shape
    k = top_k if router_logits is not None else topk_ids.shape[1]
    result = x.new_empty((T, H))
    if T == 0:
        empty = torch.empty((0,), device=x.device)
        return result, empty.to(torch.int32), empty
    ops.check_triton_device(x)
    if router_logits is not None:
        if tuple(router_logits.shape) != (T, E):
            raise ValueError(f"router_logits must be [{T}, {E}], got {tuple(router_logits.shape)}")
        check_float(x, "x", 2)
        if H != pool.fmt.hidden_size or slot_of_expert.dtype != torch.int32 or pool.device != x.device:
            raise ValueError(f"moe_forward: x [T, {pool.fmt.hidden_size}] and int32 slot_of_expert on the pool's "
                             f"device expected, got x {tuple(x.shape)} on {x.device}, {slot_of_expert.dtype}")
        if not 1 <= k <= E:
            raise ValueError(f"moe_forward: top_k={k} must be in [1, {E}]")
        _check_pool(pool)
        ids_arg = torch.empty((T, k), dtype=torch.int32, device=x.device)  # shape carrier only (not read)
    else:
        _check_call(x, topk_ids, topk_weights, pool, slot_of_expert, None, None, validate)
        ids_arg = topk_ids
    cfg = _moe_config(x, pool, E, k, config)
    plan = ops.plan_eager(ids_arg, E, cfg["BLOCK_M"], workspace.scratch, logits=router_logits,
                          renormalize=renormalize)
    if router_logits is not None:
        topk_weights = plan[1]
        if values_checked(validate, x):
            check_ids_and_slots(plan[0].view(T, k), slot_of_expert, None, pool.n_slots)
    w13, w2, group = pool_weights(pool)
    pairs = workspace.scratch("pair_out", (T * k, H), x.dtype, x.device)
    partials = ops.experts_eager(x, plan, topk_weights, w13, w2, slot_of_expert, None, group, cfg, pairs,
                                 workspace.scratch, defer_w2_reduce=True)
    if partials is not None:
        w = topk_weights.reshape(-1)
        w = w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
        return ops.combine_eager(None, k, result, partials, w), plan[0], topk_weights
    return ops.combine_eager(pairs, k, result), plan[0], topk_weights


def awq_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K, N/8] as published; packed: [K/P, N, P/8] (pack_awq_linear)
    qzeros: torch.Tensor,  # int32 [K/g, N/8]
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
    backend: str = "torch",
    *,
    config: dict | None = None,
    packed: bool = False,
    weights_checked: bool = False,
) -> torch.Tensor:
    """Dense W4A16 matmul ``x @ W``, fp32 accumulation, result [M, N] in x's dtype.

    ``packed=False``: AWQ's GEMM layout as published. ``packed=True``: weights from :func:`pack_awq_linear`, run
    by the expert kernel (no per-element gathers, asynchronous MMA at prefill: a third of the instructions); its
    ``qzeros`` / ``scales`` may be column slices of a wider packed matrix (rows read by stride). A caller whose
    weights were checked once and never change (``AWQLinear``) passes ``weights_checked`` to skip their checks
    on every call (x is still checked against them)."""
    check_float(x, "x", 2)
    K = x.shape[1]
    if weights_checked:
        k_of_w = qweight.shape[0] * qweight.shape[-1] * 8 if packed else qweight.shape[0]
        if x.device != qweight.device or k_of_w != K:
            raise ValueError(f"x {tuple(x.shape)} on {x.device} does not fit weights qweight "
                             f"{tuple(qweight.shape)} on {qweight.device}")
    else:
        if scales.dim() != 2:
            raise ValueError(f"scales must be [K/g, N], got shape {tuple(scales.shape)}")
        if packed:
            check_pool_weights(qweight[None], qzeros[None], scales[None], group_size, K, scales.shape[1], "", 1,
                               strided_rows=True)
        else:
            check_awq_weights(qweight, qzeros, scales, group_size, K, scales.shape[1], "")
        check_same_device(x.device, qweight=qweight, qzeros=qzeros, scales=scales)
    backend = resolve_backend(backend, x.device)
    flat_cfg = ops.encode_linear_config(config) if config is not None else []
    if not packed:
        return ops.awq_linear_op(x, qweight, qzeros, scales, group_size, flat_cfg, backend)
    if backend == "triton" and _eager() and x.shape[0]:
        ops.check_triton_device(x)
        return ops.linear_packed_eager(x, qweight, qzeros, scales, group_size, config, workspace.scratch)
    return ops.awq_linear_packed_op(x, qweight, qzeros, scales, group_size, flat_cfg, backend)


def pack_awq_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ as published (``qweight int32 [K, N/8]``, ``qzeros [K/g, N/8]``, ``scales [K/g, N]``) -> the kernel
    layout of :mod:`.pool` (``qweight [K/P, N, P/8]`` panel-major, natural nibble order): done once at load, for
    :func:`awq_linear` with ``packed=True``. Exact (a permutation of nibbles)."""
    from moeflow.kernels.formats.plain_layout import to_kernel_layout

    group_size = qweight.shape[0] // qzeros.shape[0]
    return {"qweight": to_kernel_layout("w2_qweight", qweight, 0, group_size),
            "qzeros": to_kernel_layout("w2_qzeros", qzeros, 0), "scales": scales.contiguous()}
