"""torch.library custom ops around the kernels (``torch.ops.moeflow.*``).

Each op takes a ``backend`` string, already resolved to ``"torch"`` (the reference of
:mod:`moeflow.kernels.reference`) or ``"triton"`` (the kernels of :mod:`moeflow.kernels.triton_kernels`,
which run under the interpreter on a CPU). Every op has a fake implementation so ``torch.compile``
traces through it without a graph break; shapes only depend on host-known sizes (no ``.item()``).

``config`` arguments are flat int lists (see :func:`encode_moe_config`); an empty list means "look it up".
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from moeflow.kernels import reference as ref
from moeflow.kernels.configs import GEMM_KEYS, lookup_config

_MOE_CFG_LEN = 1 + 2 * len(GEMM_KEYS)
_LIN_CFG_LEN = 1 + len(GEMM_KEYS)


GEMM_DEFAULTS = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}


def encode_moe_config(cfg: dict) -> list[int]:
    """{"BLOCK_M", "w13": {...}, "w2": {...}} -> flat int list (the op argument); missing keys get defaults."""
    return [int(cfg["BLOCK_M"])] + [
        int(cfg.get(w, {}).get(key, GEMM_DEFAULTS[key])) for w in ("w13", "w2") for key in GEMM_KEYS
    ]


def decode_moe_config(flat: list[int]) -> dict:
    n = len(GEMM_KEYS)
    return {
        "BLOCK_M": flat[0],
        "w13": {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1 : 1 + n], strict=False))},
        "w2": {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1 + n : 1 + 2 * n], strict=False))},
    }


def encode_linear_config(cfg: dict) -> list[int]:
    return [int(cfg["BLOCK_M"])] + [int(cfg.get(key, GEMM_DEFAULTS[key])) for key in GEMM_KEYS]


def decode_linear_config(flat: list[int]) -> dict:
    return {"BLOCK_M": flat[0], **dict(zip(GEMM_KEYS, flat[1:], strict=False))}


def _triton():
    """Import the Triton kernels; on a CPU they need the interpreter, which must be on before the import."""
    from moeflow.kernels import triton_kernels

    return triton_kernels


def _check_triton_device(t: Tensor) -> None:
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "kernels backend 'triton' on a CPU tensor needs TRITON_INTERPRET=1 set in the environment before "
            "moeflow's Triton kernels are first used (use backend='torch' or 'auto' on a CPU otherwise)"
        )
    if t.device.type == "cpu":
        tk = _triton()
        if not tk.INTERPRETED:
            raise RuntimeError(
                "moeflow.kernels.triton_kernels was imported before TRITON_INTERPRET=1 was set; "
                "set it before the first use of backend='triton' on a CPU"
            )


def _moe_dims(x: Tensor, w13_qweight: Tensor, w13_qzeros: Tensor | None, w13_scales: Tensor | None) -> tuple[int, int]:
    """(hidden, intermediate) of the pool."""
    if w13_qzeros is None:
        return w13_qweight.shape[2], w13_qweight.shape[1] // 2
    return x.shape[1], w13_scales.shape[-1] // 2


def _plan_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return -(-ref.plan_size_bound(num_pairs, num_experts, block_m) // block_m)


# ---------------------------------------------------------------------------------------------------------
# routing plan


@torch.library.custom_op("moeflow::routing_plan", mutates_args=())
def routing_plan(topk_ids: Tensor, num_experts: int, block_m: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """topk_ids int [T, k] -> (sorted_ids int32 [nb*block_m], expert_of_block int32 [nb], num_padded int32 [1])."""
    if backend == "triton":
        _check_triton_device(topk_ids)
        return _triton().plan_triton(topk_ids, num_experts, block_m)
    return ref.routing_plan_reference(topk_ids, num_experts, block_m)


@routing_plan.register_fake
def _(topk_ids, num_experts, block_m, backend):
    nb = _plan_blocks(topk_ids.numel(), num_experts, block_m)
    return (
        topk_ids.new_empty((nb * block_m,), dtype=torch.int32),
        topk_ids.new_empty((nb,), dtype=torch.int32),
        topk_ids.new_empty((1,), dtype=torch.int32),
    )


# ---------------------------------------------------------------------------------------------------------
# the two grouped GEMM stages (plan given)


@torch.library.custom_op("moeflow::moe_w13", mutates_args=())
def moe_w13(
    x: Tensor,
    sorted_ids: Tensor,
    expert_of_block: Tensor,
    qweight: Tensor,
    qzeros: Tensor | None,
    scales: Tensor | None,
    slot_of_expert: Tensor,
    expert_mask: Tensor | None,
    top_k: int,
    group_size: int,
    config: list[int],
    backend: str,
) -> Tensor:
    """h [T*k, I] = silu(x[row] @ W1) * (x[row] @ W3) for the pairs of selected experts (other rows undefined)."""
    _, inter = _moe_dims(x, qweight, qzeros, scales)
    num_pairs = x.shape[0] * top_k
    h = x.new_empty((num_pairs, inter))
    if num_pairs == 0:
        return h
    weights = (qweight, qzeros, scales)
    if backend == "triton":
        _check_triton_device(x)
        cfg = decode_moe_config(config)["w13"]
        return _triton().grouped_gemm_triton(
            0, x, weights, h, sorted_ids, expert_of_block, slot_of_expert, expert_mask, None,
            num_pairs, top_k, inter, group_size, cfg,
        )
    return ref.w13_stage_reference(x, sorted_ids, expert_of_block, top_k, weights, slot_of_expert, expert_mask,
                                   group_size, h)


@moe_w13.register_fake
def _(x, sorted_ids, expert_of_block, qweight, qzeros, scales, slot_of_expert, expert_mask, top_k, group_size,
      config, backend):
    _, inter = _moe_dims(x, qweight, qzeros, scales)
    return x.new_empty((x.shape[0] * top_k, inter))


@torch.library.custom_op("moeflow::moe_w2", mutates_args=("out",))
def moe_w2(
    h: Tensor,
    sorted_ids: Tensor,
    expert_of_block: Tensor,
    topk_weights: Tensor | None,
    qweight: Tensor,
    qzeros: Tensor | None,
    scales: Tensor | None,
    slot_of_expert: Tensor,
    expert_mask: Tensor | None,
    group_size: int,
    config: list[int],
    backend: str,
    out: Tensor,
) -> None:
    """out[pair] = (h[pair] @ W2) * weight[pair] for the pairs of selected experts; other rows untouched."""
    num_pairs = out.shape[0]
    if num_pairs == 0:
        return
    weights = (qweight, qzeros, scales)
    w = None if topk_weights is None else topk_weights.reshape(-1).float().contiguous()
    if backend == "triton":
        _check_triton_device(h)
        cfg = decode_moe_config(config)["w2"]
        _triton().grouped_gemm_triton(
            1, h, weights, out, sorted_ids, expert_of_block, slot_of_expert, expert_mask, w,
            num_pairs, 1, out.shape[1], group_size, cfg,
        )
        return
    ref.w2_stage_reference(h, sorted_ids, expert_of_block, w, weights, slot_of_expert, expert_mask, group_size, out)


@moe_w2.register_fake
def _(h, sorted_ids, expert_of_block, topk_weights, qweight, qzeros, scales, slot_of_expert, expert_mask,
      group_size, config, backend, out):
    return None


# ---------------------------------------------------------------------------------------------------------
# the whole expert compute of one layer (plan + w13 + w2) in one op


@torch.library.custom_op("moeflow::expert_forward", mutates_args=("out",))
def expert_forward_op(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13_qweight: Tensor,
    w13_qzeros: Tensor | None,
    w13_scales: Tensor | None,
    w2_qweight: Tensor,
    w2_qzeros: Tensor | None,
    w2_scales: Tensor | None,
    slot_of_expert: Tensor,
    expert_mask: Tensor | None,
    group_size: int,
    config: list[int],
    backend: str,
    out: Tensor,
) -> None:
    """Fill the rows of ``out`` [T*k, H] whose expert ``expert_mask`` selects (all when None)."""
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return
    num_experts = slot_of_expert.shape[0]
    top_k = topk_ids.shape[1]
    hidden, inter = _moe_dims(x, w13_qweight, w13_qzeros, w13_scales)
    if not config:
        kind = "dense" if w13_qzeros is None else "awq"
        cfg = lookup_config("moe", x.shape[0], kind=kind, dtype=x.dtype, group_size=group_size if kind == "awq" else 0,
                            num_experts=num_experts, top_k=top_k, n=inter, k=hidden, device=x.device)
        config = encode_moe_config(cfg)
    sorted_ids, expert_of_block, _ = routing_plan(topk_ids, num_experts, config[0], backend)
    h = moe_w13(x, sorted_ids, expert_of_block, w13_qweight, w13_qzeros, w13_scales, slot_of_expert, expert_mask,
                top_k, group_size, config, backend)
    moe_w2(h, sorted_ids, expert_of_block, topk_weights, w2_qweight, w2_qzeros, w2_scales, slot_of_expert,
           expert_mask, group_size, config, backend, out)


@expert_forward_op.register_fake
def _(x, topk_ids, topk_weights, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales,
      slot_of_expert, expert_mask, group_size, config, backend, out):
    return None


# ---------------------------------------------------------------------------------------------------------
# combine and the dense AWQ linear


@torch.library.custom_op("moeflow::combine", mutates_args=())
def combine_op(y: Tensor, top_k: int, backend: str) -> Tensor:
    """y [T*k, H] -> [T, H]: fp32 sum of each token's k rows in k order."""
    if backend == "triton" and y.numel():
        _check_triton_device(y)
        return _triton().combine_triton(y, top_k)
    return ref.combine_reference(y, top_k)


@combine_op.register_fake
def _(y, top_k, backend):
    return y.new_empty((y.shape[0] // top_k, y.shape[1]))


@torch.library.custom_op("moeflow::awq_linear", mutates_args=())
def awq_linear_op(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int, config: list[int], backend: str
) -> Tensor:
    """x [M, K] @ dequantize(qweight, qzeros, scales) -> [M, N] in x's dtype (fp32 accumulation)."""
    M, K = x.shape
    N = scales.shape[1]
    if backend != "triton" or M == 0:
        return ref.awq_linear_reference(x, qweight, qzeros, scales, group_size)
    _check_triton_device(x)
    if not config:
        cfg = lookup_config("linear", M, kind="awq", dtype=x.dtype, group_size=group_size, num_experts=1, top_k=1,
                            n=N, k=K, device=x.device)
        config = encode_linear_config(cfg)
    cfg = decode_linear_config(config)
    bm = cfg["BLOCK_M"]
    n_blocks = -(-M // bm)
    sorted_ids = torch.arange(n_blocks * bm, dtype=torch.int32, device=x.device)  # >= M means padding
    expert_of_block = torch.zeros((n_blocks,), dtype=torch.int32, device=x.device)
    slot = torch.zeros((1,), dtype=torch.int32, device=x.device)
    out = x.new_empty((M, N))
    weights = (qweight.unsqueeze(0), qzeros.unsqueeze(0), scales.unsqueeze(0))
    return _triton().grouped_gemm_triton(
        1, x, weights, out, sorted_ids, expert_of_block, slot, None, None, M, 1, N, group_size, cfg,
    )


@awq_linear_op.register_fake
def _(x, qweight, qzeros, scales, group_size, config, backend):
    return x.new_empty((x.shape[0], scales.shape[1]))
