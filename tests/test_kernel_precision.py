"""Accumulation precision at Mixtral's K (4096 = hidden, 14336 = intermediate): fp32 accumulation, seen.

Inputs are exact in the activation dtype (x rounded to fp16/bf16 first; weights with power-of-two scales, so the
dequantized W is exact in any float format): the fp32 product of those inputs is the right answer up to one
rounding of the output. Error = max |got - ref| / max |ref|, tolerance = one output ulp at the top of the range
(fp16 2^-10, bf16 2^-7; the interpreter truncates bf16 stores, which costs up to one ulp instead of half).

Measured (M=16, N=16, BLOCK_K=64, seed 0) when this was written:

  dtype  K      fp32 accumulation (kernel)   half accumulation (emulated below)   tolerance
  fp16   4096   3.0e-4                       2.9e-3                               9.8e-4
  fp16   14336  3.0e-4                       3.1e-3                               9.8e-4
  bf16   4096   5.0e-3                       1.7e-2                               7.8e-3
  bf16   14336  4.7e-3                       3.6e-2                               7.8e-3

so rounding the accumulator to the activation dtype at every k-step fails; each test also computes that variant
and asserts that it fails, so the tolerance keeps its teeth.
"""

from __future__ import annotations

import pytest
import torch

from moeflow import kernels
from moeflow.quant.awq import dequantize, pack_int4

M, N, GROUP, BLOCK_K = 16, 16, 128, 64
TOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def exact_inputs(K: int, dtype: torch.dtype, seed: int = 0):
    """x [M, K] in dtype; AWQ qweight/qzeros/scales whose dequantized W [K, N] is exact in dtype; W in fp32."""
    gen = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (K, N), generator=gen))
    qzeros = pack_int4(torch.full((K // GROUP, N), 8))
    scales = torch.full((K // GROUP, N), 2.0**-6, dtype=dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x, qweight, qzeros, scales, dequantize(qweight, qzeros, scales.float(), GROUP)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def half_accumulation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bug: the accumulator rounded to x's dtype after every BLOCK_K step (fp32 products within a step)."""
    acc = torch.zeros(x.shape[0], w.shape[1])
    for k0 in range(0, x.shape[1], BLOCK_K):
        acc = (acc + x[:, k0 : k0 + BLOCK_K].float() @ w[k0 : k0 + BLOCK_K]).to(x.dtype).float()
    return acc.to(x.dtype)


@pytest.mark.parametrize("K", [4096, 14336])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_gemm_accumulates_in_fp32(backend, dtype, K):
    x, qweight, qzeros, scales, w = exact_inputs(K, dtype)
    ref = x.float() @ w
    assert rel_error(half_accumulation(x, w), ref) > TOL[dtype]  # the tolerance sees half accumulation
    config = {"BLOCK_M": 16, "BLOCK_N": N, "BLOCK_K": BLOCK_K, "SPLIT_K": 1}  # BLOCK_M >= 16: the tl.dot path
    got = kernels.awq_linear(x, qweight, qzeros, scales, GROUP, backend, config=config)
    assert got.dtype == dtype
    assert rel_error(got, ref) <= TOL[dtype], f"{backend} {dtype} K={K}: {rel_error(got, ref):.2e}"
