"""The load-time quantizers' fast forms (moeflow/quant/awq.py: codes packed as bytes, groups reduced along K in
place; moeflow/quant/fp8.py: block scales broadcast) are bitwise the plain formulas they replaced, kept here as
the reference: FP8 checkpoints (DeepSeek-V3/V3.2, MiniMax-M2, GLM-5) requantize every expert through them."""

from __future__ import annotations

import pytest
import torch

from moeflow.quant.awq import AWQ_ORDER, pack_int4, quantize_rtn
from moeflow.quant.fp8 import dequantize_fp8_block


def reference_pack(values: torch.Tensor) -> torch.Tensor:
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    packed = torch.zeros(v.shape[:2], dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= v[:, :, column] << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def reference_quantize(weight: torch.Tensor, group_size: int):
    n, k = weight.shape
    g = weight.float().T.contiguous().reshape(k // group_size, group_size, n)
    scales = ((g.amax(dim=1) - g.amin(dim=1)).clamp(min=1e-5) / 15.0).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(g.amin(dim=1) / s)).clamp(0, 15)
    q = (torch.round(g / s.unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15).reshape(k, n)
    return reference_pack(q), reference_pack(zeros), scales


@pytest.mark.parametrize("n,k,group", [(8, 32, 32), (48, 64, 64), (96, 256, 64), (512, 1024, 128), (40, 384, 128)])
def test_quantize_rtn_is_the_plain_formula(n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    w[0, :group] = 0.5  # a constant group: the scale clamp
    w[1, :group] = torch.linspace(-1, 1, group)  # values on rounding edges
    got = quantize_rtn(w, group)
    qweight, qzeros, scales = reference_quantize(w, group)
    assert torch.equal(got.qweight, qweight) and torch.equal(got.qzeros, qzeros) and torch.equal(got.scales, scales)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    assert torch.equal(pack_int4(codes), reference_pack(codes))


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300)])  # whole 128 x 128 blocks, and ragged edges
def test_fp8_block_dequantization_is_the_plain_formula(n, k):
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen)
    want = w.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(dequantize_fp8_block(w, scale, (128, 128)), want)
