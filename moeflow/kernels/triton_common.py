"""What every Triton kernel module shares. Importing it imports triton: on a CPU, ``TRITON_INTERPRET=1`` must be
set before the first import (the kernels are then built for the interpreter)."""

from __future__ import annotations

import os

import torch
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # kernels below were built for the CPU interpreter

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (``triton.cdiv`` is a slow wrapper on the launch path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
