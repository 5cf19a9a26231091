"""What every Triton kernel module shares. Importing it imports triton: on a CPU, ``TRITON_INTERPRET=1`` must be
set before the first import (the kernels are then built for the interpreter)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # kernels below were built for the CPU interpreter


def _interpreter_scalar_index_fix() -> bool:
    """Let the interpreter use a loaded scalar as a Python int (``range(0, n, B)``) with numpy >= 2.5.

    Triton <= 3.6's interpreter turns a scalar into an int with ``int(data)`` on its 1-element 1-d array, which
    numpy 2.5 refuses ("only 0-dimensional arrays can be converted"); later Triton squeezes first. Detected by
    behaviour on a stand-in class (no version check); returns whether the fix was installed."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return False

    class Probe:
        class handle:  # noqa: N801 (mirrors the interpreter's tensor.handle)
            data = np.zeros(1, dtype=np.int32)

    try:
        original(Probe, scope_type())
        Probe().__index__()
        return False  # this Triton converts 1-element arrays itself
    except TypeError:
        pass
    except Exception:  # the interpreter's internals changed shape: leave them alone
        return False

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


INTERPRETER_INDEX_FIXED = INTERPRETED and _interpreter_scalar_index_fix()

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (``triton.cdiv`` is a slow wrapper on the launch path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def block_expert(eob_ptr, pid_m, mask_ptr, HAS_MASK: tl.constexpr):
    """The expert of plan block ``pid_m``, or -1 when past the padded count or not in ``expert_mask``."""
    expert = tl.load(eob_ptr + pid_m)
    if HAS_MASK:
        selected = tl.load(mask_ptr + tl.maximum(expert, 0)) != 0
        expert = tl.where(selected, expert, -1)
    return expert


@triton.jit
def plan_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, DOT_M: tl.constexpr, TOPK: tl.constexpr,
              MODE: tl.constexpr):
    """Plan block ``pid_m``'s pairs [DOT_M] (``num_pairs`` past its BLOCK_M), which are real, and the activation
    row each reads (int64; MODE 0: the token, pair // TOPK; MODE 1: the pair). Padding rows are never stored;
    they read token 0 (MODE 0) or the block's first pair (MODE 1: that row was computed for this block's expert,
    where pair 0's row may belong to an expert a staged run has not computed yet: memory nothing wrote)."""
    r = tl.arange(0, DOT_M)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + r, mask=r < BLOCK_M, other=num_pairs)
    row_ok = pair < num_pairs
    if MODE == 0:
        row = tl.where(row_ok, pair // TOPK, 0)
    else:
        row = tl.where(row_ok, pair, tl.load(sorted_ptr + pid_m * BLOCK_M))  # a live block's first pair is real
    return pair, row_ok, row.to(tl.int64)


@triton.jit
def gemm_epilogue(acc, c_ptr, stride_cm, pair, row_ok, n0, N, weight_ptr,
                  MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, alpha, limit, ACT: tl.constexpr):
    """acc fp32 [M, BLOCK_N] of weight columns n0.. -> MODE 0: silu(gate) * up (ACT 0) or gpt-oss's
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)`` (ACT 1), columns
    interleaved, into h[pair, n0/2 ..]; MODE 1: times the pair's routing weight into out[pair, n0 ..]. fp32 until
    the store. Shared by the AWQ and MXFP4 expert kernels (both store w13's rows gate / up interleaved)."""
    if MODE == 0:
        gate, up = tl.split(tl.reshape(acc, [acc.shape[0], BLOCK_N // 2, 2]))
        if ACT == 0:
            res = gate / (1.0 + tl.exp(-gate)) * up
        else:
            g = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            res = (up + 1.0) * (g / (1.0 + tl.exp(-(g * alpha))))
        cols = n0 // 2 + tl.arange(0, BLOCK_N // 2)
        n_out = N // 2
    else:
        res = acc
        if HAS_WEIGHT:
            res = res * tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        cols = n0 + tl.arange(0, BLOCK_N)
        n_out = N
    ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(ptrs, res.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < n_out))


@triton.jit
def splitk_fixup(acc, ws, stride_wsp, ok, split, cnt_ptr, pid, bias_rows, c_ptr, stride_cm, pair, row_ok, n0, N,
                 weight_ptr, MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, alpha, limit,
                 ACT: tl.constexpr, SPLIT_K: tl.constexpr):
    """The serial split-K fixup of the AWQ and MXFP4 expert kernels: store this program's fp32 partial acc
    [M, BLOCK_N] at ``ws + split * stride_wsp`` (``ws``: split 0's tile, ``ok`` its store mask), then count the
    tile's arrivals on ``cnt_ptr + pid``; the last of its ``SPLIT_K`` programs sums the partials in split order
    (the same bits whoever arrives last), adds the bias (``bias_rows`` [BLOCK_N] pointers, or None) once, runs
    :func:`gemm_epilogue` and sets the counter back to 0 (a CUDA-graph replay finds it zero).

    Memory order as in CUTLASS's semaphore (``include/cutlass/barrier.h``): a CTA barrier so every thread's
    partial is stored before one thread's acq_rel GPU-scope atomic (the release); the last arriver's barrier after
    that atomic (the acquire) orders its threads' ``.cg`` loads (L2, not a stale L1) after the others' stores."""
    tl.store(ws + split * stride_wsp, acc, mask=ok)
    tl.debug_barrier()  # every thread's partial stored before the release below
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible
        tl.debug_barrier()
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: the same bits whoever arrives last
            total += tl.load(ws + s * stride_wsp, mask=ok, other=0.0, cache_modifier=".cg")
        if bias_rows is not None:  # after the sum: added once
            total += tl.load(bias_rows).to(tl.float32)[None, :]
        gemm_epilogue(total, c_ptr, stride_cm, pair, row_ok, n0, N, weight_ptr, MODE, HAS_WEIGHT, BLOCK_N,
                      alpha, limit, ACT)
        tl.store(cnt_ptr + pid, 0)  # replay-safe: the next launch (stream-ordered) finds it zero


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE's precision (to nearest, ties to even), still fp32: what torch's op in DTYPE gives.
    bf16 by bit arithmetic because the interpreter truncates a cast to bf16 (the GPU rounds); a value so rounded
    casts to bf16 exactly either way."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)
