"""The kernels' launch paths: eager launchers (called directly, no dispatcher) and ``torch.library`` custom ops
around the same launchers (``torch.ops.moeflow.*``) for ``torch.compile``.

Each op takes a ``backend`` string, already resolved to ``"torch"`` (the reference of
:mod:`moeflow.kernels.experts.reference`) or ``"triton"`` (the Triton kernels, which run under the interpreter on a
CPU). Every op has a fake implementation so ``torch.compile`` traces through it without a graph break; shapes
only depend on host-known sizes (no ``.item()``). The eager launchers take an ``alloc`` for their intermediates:
:func:`moeflow.kernels.workspace.scratch` on the hot path (no allocation per call), fresh tensors inside ops.

``config`` arguments are flat int lists (see :func:`encode_moe_config`); an empty list means "look it up".
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from moeflow.kernels import workspace
from moeflow.kernels.custom_op import custom_op
from moeflow.kernels.experts import reference as ref
from moeflow.kernels.experts.configs import GEMM_DEFAULTS, GEMM_KEYS, lookup_config

Alloc = Callable[[str, tuple, torch.dtype, torch.device], Tensor]


def fresh(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The ``alloc`` of the custom ops: a new tensor per call (ops must not return shared buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def encode_moe_config(cfg: dict) -> list[int]:
    """{"BLOCK_M", "w13": {...}, "w2": {...}} -> flat int list (the op argument); missing keys get defaults."""
    return [int(cfg["BLOCK_M"])] + [
        int(cfg.get(w, {}).get(key, GEMM_DEFAULTS[key])) for w in ("w13", "w2") for key in GEMM_KEYS
    ]


def decode_moe_config(flat: list[int]) -> dict:
    n = len(GEMM_KEYS)
    return {
        "BLOCK_M": flat[0],
        "w13": {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1 : 1 + n], strict=True))},
        "w2": {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1 + n : 1 + 2 * n], strict=True))},
    }


def encode_linear_config(cfg: dict) -> list[int]:
    return [int(cfg["BLOCK_M"])] + [int(cfg.get(key, GEMM_DEFAULTS[key])) for key in GEMM_KEYS]


def decode_linear_config(flat: list[int]) -> dict:
    return {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1:], strict=True))}


def check_triton_device(t: Tensor) -> None:
    """Triton on a CPU tensor needs the interpreter, switched on before the kernels were imported."""
    if t.device.type != "cpu":
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "kernels backend 'triton' on a CPU tensor needs TRITON_INTERPRET=1 set in the environment before "
            "moeflow's Triton kernels are first used (use backend='torch' or 'auto' on a CPU otherwise)"
        )
    from moeflow.kernels import triton_common

    if not triton_common.INTERPRETED:
        raise RuntimeError(
            "moeflow's Triton kernels were imported before TRITON_INTERPRET=1 was set; "
            "set it before the first use of backend='triton' on a CPU"
        )


def moe_dims(x: Tensor, w13_qweight: Tensor, w13_qzeros: Tensor | None) -> tuple[int, int]:
    """(hidden, intermediate) of the pool (kernel layout: w13 rows = 2I for both kinds)."""
    return x.shape[1], w13_qweight.shape[-2] // 2


def resolve_moe_config(x: Tensor, num_experts: int, top_k: int, w13_qzeros: Tensor | None, group_size: int,
                       inter: int) -> dict:
    """The (cached) table/heuristic config of a MoE layer for this T."""
    kind = "dense" if w13_qzeros is None else "awq"
    return lookup_config("moe", x.shape[0], kind=kind, dtype=x.dtype, group_size=group_size if kind == "awq" else 0,
                         num_experts=num_experts, top_k=top_k, n=inter, k=x.shape[1], device=x.device)


# ---------------------------------------------------------------------------------------------------------
# eager launchers (Triton)


def plan_eager(topk_ids: Tensor, num_experts: int, block_m: int, alloc: Alloc,
               logits: Tensor | None = None, renormalize: bool = True, gate: Tensor | None = None):
    """(ids int32 [P], weights fp32 [P] | None, sorted_ids, expert_of_block, num_padded) in one launch.

    ``topk_ids`` int [T, k] is read, or, with ``logits`` [T, E] (or x [T, H] and ``gate`` [E, H]), an
    int [T, k] placeholder whose shape gives T and k; ids and weights are then computed by the same launch.
    """
    from moeflow.kernels.routing.plan import plan_blocks, route_plan

    T, k = topk_ids.shape
    num_pairs, dev = T * k, topk_ids.device
    nb = plan_blocks(num_pairs, num_experts, block_m)
    sorted_ids = alloc("sorted_ids", (nb * block_m,), torch.int32, dev)
    eob = alloc("expert_of_block", (nb,), torch.int32, dev)
    npad = alloc("num_padded", (1,), torch.int32, dev)
    if logits is not None:
        ids = alloc("topk_ids", (num_pairs,), torch.int32, dev)
        wts = alloc("topk_weights", (num_pairs,), torch.float32, dev)
    else:
        ids = topk_ids.reshape(-1)
        if ids.dtype != torch.int32 or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        wts = None
    route_plan(logits, ids, wts, sorted_ids, eob, npad, T, k, num_experts, block_m, renormalize, gate)
    return ids, wts, sorted_ids, eob, npad


def experts_eager(
    x: Tensor, plan: tuple, topk_weights: Tensor, w13: tuple, w2: tuple, slot_of_expert: Tensor,
    expert_mask: Tensor | None, group_size: int, cfg: dict, out: Tensor, alloc: Alloc, defer_w2_reduce: bool = False,
) -> Tensor | None:
    """w13 + w2 over a plan; fills ``out`` [P, H] (selected pairs). With ``defer_w2_reduce`` and a split w2,
    returns its fp32 partials [SPLIT_K, P, H] instead (for the combine to sum) and leaves ``out`` alone."""
    from moeflow.kernels.experts.gemm import expert_gemm

    ids, _, sorted_ids, eob, _ = plan
    num_pairs = ids.numel()
    top_k = num_pairs // x.shape[0]
    inter = w13[0].shape[-2] // 2
    c13, c2 = {**cfg["w13"], "BLOCK_M": cfg["BLOCK_M"]}, {**cfg["w2"], "BLOCK_M": cfg["BLOCK_M"]}
    dev = x.device
    h = alloc("h", (num_pairs, inter), x.dtype, dev)
    s13, s2 = int(c13.get("SPLIT_K", 1)), int(c2.get("SPLIT_K", 1))
    ws13 = alloc("ws13", (s13, num_pairs, 2 * inter), torch.float32, dev) if s13 > 1 else None
    expert_gemm(0, x, w13, h, sorted_ids, eob, slot_of_expert, expert_mask, None, num_pairs, top_k, group_size, c13,
                ws=ws13)
    w = topk_weights.reshape(-1)
    if w.dtype != torch.float32 or not w.is_contiguous():
        w = w.float().contiguous()
    ws2 = alloc("ws2", (s2, num_pairs, out.shape[1]), torch.float32, dev) if s2 > 1 else None
    expert_gemm(1, h, w2, out, sorted_ids, eob, slot_of_expert, expert_mask, w, num_pairs, 1, group_size, c2,
                ws=ws2, reduce=not defer_w2_reduce)
    return ws2 if (defer_w2_reduce and s2 > 1) else None


def combine_eager(y: Tensor | None, top_k: int, out: Tensor, partials: Tensor | None = None,
                  topk_weights: Tensor | None = None) -> Tensor:
    from moeflow.kernels.experts.combine import combine

    if y is not None and y.stride(-1) != 1:
        y = y.contiguous()
    return combine(y, top_k, out, partials, topk_weights)


# ---------------------------------------------------------------------------------------------------------
# custom ops (torch.compile); the triton branches call the eager launchers with fresh allocations


@custom_op("moeflow::routing_plan", mutates_args=())
def routing_plan(topk_ids: Tensor, num_experts: int, block_m: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """topk_ids int [T, k] -> (sorted_ids int32 [nb*block_m], expert_of_block int32 [nb], num_padded int32 [1])."""
    if backend == "triton":
        check_triton_device(topk_ids)
        return plan_eager(topk_ids, num_experts, block_m, fresh)[2:]
    return ref.routing_plan_reference(topk_ids, num_experts, block_m)


@routing_plan.register_fake
def _(topk_ids, num_experts, block_m, backend):
    nb = -(-ref.plan_size_bound(topk_ids.numel(), num_experts, block_m) // block_m)
    return (topk_ids.new_empty((nb * block_m,), dtype=torch.int32), topk_ids.new_empty((nb,), dtype=torch.int32),
            topk_ids.new_empty((1,), dtype=torch.int32))


def plan_and_hidden(x: Tensor, topk_ids: Tensor, num_experts: int, block_m: int, width: int,
                    alloc: Alloc | None) -> tuple[Tensor, Tensor, Tensor]:
    """The routing plan and the w13 stage's output of a grouped expert launch: (sorted_ids int32, expert_of_block
    int32, h [T*k, width] in x's dtype) for topk_ids int [T, k]. Fresh tensors (the plan through
    :func:`routing_plan`), or with ``alloc`` the caller's persistent buffers (static shapes: a captured graph's)."""
    rows = topk_ids.numel()
    if alloc is None:
        sorted_ids, expert_of_block, _ = routing_plan(topk_ids, num_experts, block_m, "triton")
        return sorted_ids, expert_of_block, x.new_empty((rows, width))
    sorted_ids, expert_of_block = plan_eager(topk_ids, num_experts, block_m, alloc)[2:4]
    return sorted_ids, expert_of_block, alloc("h", (rows, width), x.dtype, x.device)


def split_k_partials(shape: tuple[int, int, int], mode: int, device: torch.device, alloc: Alloc | None) -> Tensor:
    """fp32 split-K partials [split, pairs, columns] of stage ``mode`` (0: w13, 1: w2): the reused scratch buffer
    (w13 and w2 share it: stream order keeps their launches apart), or with ``alloc`` the caller's "ws13" / "ws2"."""
    if alloc is None:
        return workspace.scratch(workspace.SPLIT_K_PARTIALS, shape, torch.float32, device)
    return alloc(f"ws{13 if mode == 0 else 2}", shape, torch.float32, device)


@custom_op("moeflow::route", mutates_args=())
def route_op(logits: Tensor, top_k: int, renormalize: bool, gate: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] (or x [T, H] with ``gate`` [E, H]) -> (topk_ids int32 [T, k], topk_weights fp32 [T, k]):
    softmax in fp32, top-k, optional renormalisation (Mixtral's router)."""
    T = logits.shape[0]
    E = gate.shape[0] if gate is not None else logits.shape[1]
    if backend == "triton":
        check_triton_device(logits)
        placeholder = logits.new_empty((T, top_k), dtype=torch.int32)
        ids, wts, *_ = plan_eager(placeholder, E, 1, fresh, logits=logits, renormalize=renormalize, gate=gate)
        return ids.view(T, top_k), wts.view(T, top_k)
    if gate is not None:
        logits = torch.nn.functional.linear(logits, gate)
    return ref.route_reference(logits, top_k, renormalize)


@route_op.register_fake
def _(logits, top_k, renormalize, gate, backend):
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int32), logits.new_empty((T, top_k), dtype=torch.float32))


@custom_op("moeflow::expert_forward", mutates_args=("out",))
def expert_forward_op(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
    w13_qweight: Tensor, w13_qzeros: Tensor | None, w13_scales: Tensor | None,
    w2_qweight: Tensor, w2_qzeros: Tensor | None, w2_scales: Tensor | None,
    slot_of_expert: Tensor, expert_mask: Tensor | None, group_size: int, config: list[int], backend: str,
    out: Tensor,
) -> None:
    """Fill the rows of ``out`` [T*k, H] whose expert ``expert_mask`` selects (all when None)."""
    if topk_ids.numel() == 0:
        return
    w13, w2 = (w13_qweight, w13_qzeros, w13_scales), (w2_qweight, w2_qzeros, w2_scales)
    if backend != "triton":
        ref.expert_forward_pool_reference(x, topk_ids, topk_weights, w13, w2, slot_of_expert, expert_mask,
                                          group_size, out)
        return
    check_triton_device(x)
    E, k = slot_of_expert.shape[0], topk_ids.shape[1]
    cfg = (decode_moe_config(config) if config
           else resolve_moe_config(x, E, k, w13_qzeros, group_size, w13_qweight.shape[-2] // 2))
    plan = plan_eager(topk_ids, E, cfg["BLOCK_M"], fresh)
    experts_eager(x, plan, topk_weights, w13, w2, slot_of_expert, expert_mask, group_size, cfg, out, fresh)


@expert_forward_op.register_fake
def _(x, topk_ids, topk_weights, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales,
      slot_of_expert, expert_mask, group_size, config, backend, out):
    return None


@custom_op("moeflow::combine", mutates_args=())
def combine_op(y: Tensor, top_k: int, backend: str) -> Tensor:
    """y [T*k, H] -> [T, H]: fp32 sum of each token's k rows in k order."""
    if backend == "triton" and y.numel():
        check_triton_device(y)
        return combine_eager(y, top_k, y.new_empty((y.shape[0] // top_k, y.shape[1])))
    return ref.combine_reference(y, top_k)


@combine_op.register_fake
def _(y, top_k, backend):
    return y.new_empty((y.shape[0] // top_k, y.shape[1]))


@custom_op("moeflow::awq_linear", mutates_args=())
def awq_linear_op(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int, config: list[int], backend: str
) -> Tensor:
    """x [M, K] @ dequantize(qweight, qzeros, scales) -> [M, N] in x's dtype (fp32 accumulation)."""
    M, K = x.shape
    N = scales.shape[1]
    if backend != "triton" or M == 0:
        return ref.awq_linear_reference(x, qweight, qzeros, scales, group_size)
    check_triton_device(x)
    if not config:
        cfg = lookup_config("linear", M, kind="awq", dtype=x.dtype, group_size=group_size, num_experts=1, top_k=1,
                            n=N, k=K, device=x.device)
        config = encode_linear_config(cfg)
    return linear_eager(x, qweight, qzeros, scales, group_size, decode_linear_config(config))


@awq_linear_op.register_fake
def _(x, qweight, qzeros, scales, group_size, config, backend):
    return x.new_empty((x.shape[0], scales.shape[1]))


def linear_eager(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int, cfg: dict) -> Tensor:
    """Launch the published-AWQ GEMM: x [M, K] -> [M, N] (a fresh tensor)."""
    from moeflow.kernels.experts.linear import awq_linear_triton

    return awq_linear_triton(x, qweight, qzeros, scales, group_size, cfg)


def linear_packed_eager(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
                        cfg: dict | None, alloc: Alloc) -> Tensor:
    """x [M, K] @ W with W in the pool's kernel layout (``qweight [K/P, N, P/8]``): the expert GEMM, one expert.

    Per call only the launch (a split K is reduced inside it: the fixup): the config comes from a
    cache per (M, N, K, group), the constant plan from a cache per (blocks, device)."""
    from moeflow.kernels.experts.configs import packed_linear_config
    from moeflow.kernels.experts.gemm import expert_gemm

    M, N = x.shape[0], scales.shape[1]
    cfg = cfg or packed_linear_config(M, N, x.shape[1], group_size)
    sorted_ids, expert_of_block, slots = _dense_plan(M, cfg["BLOCK_M"], x.device)
    out = x.new_empty((M, N))
    split = cfg["SPLIT_K"] if "SPLIT_K" in cfg else 1
    ws = alloc("linear_ws", (split, M, N), torch.float32, x.device) if split > 1 else None
    return expert_gemm(1, x, (qweight, qzeros, scales), out, sorted_ids, expert_of_block, slots,
                       None, None, M, 1, group_size, cfg, ws=ws)


_DENSE_PLANS: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}


def _dense_plan(rows: int, block_m: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The constant plan of a dense GEMM of ``rows`` rows through the expert kernel, made once per (rows, block,
    device), not per call: (sorted_ids int32 [nb * block_m] = 0.. (>= rows: padding), expert_of_block int32 [nb]
    all expert 0, slot_of_expert int32 [1] = slot 0)."""
    nb = -(-rows // block_m)
    key = (nb, block_m, device)
    plan = _DENSE_PLANS.get(key)
    if plan is None:
        zeros = torch.zeros((max(nb, 1),), dtype=torch.int32, device=device)
        plan = (torch.arange(nb * block_m, dtype=torch.int32, device=device), zeros[:nb], zeros[:1])
        _DENSE_PLANS[key] = plan
    return plan


@custom_op("moeflow::awq_linear_packed", mutates_args=())
def awq_linear_packed_op(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int, config: list[int], backend: str
) -> Tensor:
    """x [M, K] @ W, W packed by ``kernels.pack_awq_linear`` (``qweight [K/P, N, P/8]``) -> [M, N] in x's dtype."""
    if backend != "triton" or x.shape[0] == 0:
        w_t = ref.dequantize_kernel_layout(qweight, qzeros, scales, group_size)
        return (x.float() @ w_t.T).to(x.dtype)
    check_triton_device(x)
    return linear_packed_eager(x, qweight, qzeros, scales, group_size,
                               decode_linear_config(config) if config else None, fresh)


@awq_linear_packed_op.register_fake
def _(x, qweight, qzeros, scales, group_size, config, backend):
    return x.new_empty((x.shape[0], scales.shape[1]))
