"""What every Triton kernel module shares. Importing it imports triton: on a CPU, ``TRITON_INTERPRET=1`` must be
set before the first import (the kernels are then built for the interpreter)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # kernels below were built for the CPU interpreter

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
    row each reads (int64; MODE 0: the token, pair // TOPK; MODE 1: the pair; padding rows read row 0)."""
    r = tl.arange(0, DOT_M)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + r, mask=r < BLOCK_M, other=num_pairs)
    row_ok = pair < num_pairs
    if MODE == 0:
        row = pair // TOPK
    else:
        row = pair
    row = tl.where(row_ok, row, 0).to(tl.int64)  # padding rows read row 0 and are never stored
    return pair, row_ok, row
