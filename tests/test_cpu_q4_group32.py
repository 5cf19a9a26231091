"""moeflow's CPU q4 kernel at group 32 with integer zero points (issue 42): the zero point folded into each block's
integer sum, one fp32 fma per block. The zero-point-free form of GGUF's Q4_0 (``Q4_F16Z8``) and the form with
stored zero points 8 (``Q4_F16Z``) give the same bits; tail rows the grouped rows' bits; every token count and the
expert within fp32 rounding of the plain-torch fp32 reference of the same weights and int8 activations. ~3 s."""

from __future__ import annotations

import pytest
import torch

from moeflow.kernels.cpu.matrix_reference import q4_expert_reference, q4_reference, quantize_activations
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4_F16Z, Q4_F16Z8, Q4Matrix, group_rows, q4_expert, q4_matmul
from moeflow.quant.ggml import dequantize, q4_0_codes

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")


def q4_0_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q4_0 rows as a GGUF file stores them: uint8 [n, k/32 * 18] (fp16 d, then 16 bytes of nibbles)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n * k // 32, 1, generator=g) * 0.02 + 1e-3).half().view(torch.uint8)
    qs = torch.randint(0, 256, (n * k // 32, 16), generator=g, dtype=torch.uint8)
    return torch.cat([d, qs], dim=1).reshape(n, -1)


def both_forms(n: int, k: int, seed: int) -> tuple[Q4Matrix, Q4Matrix, torch.Tensor]:
    """(the Q4_F16Z8 matrix, the Q4_F16Z matrix with zero points 8, ggml's dequantized weight fp32 [n, k])."""
    raw = q4_0_blocks(n, k, seed)
    codes, d = q4_0_codes(raw)
    z8 = Q4Matrix.from_q4_0(codes, d)
    zs = Q4Matrix(z8.packed, z8.scales, group_rows(torch.full((n, k // 32), 8, dtype=torch.uint8)), 32)
    return z8, zs, dequantize(raw, 2)


@pytest.mark.parametrize("n", [8 * 6, 8 * 5 + 3, 5, 16 + 7])
def test_q4_0_forms_agree_bitwise_and_match_the_reference(n):
    z8, zs, w = both_forms(n, 256, seed=n)
    assert (z8.fmt, zs.fmt) == (Q4_F16Z8, Q4_F16Z) and z8.mins.numel() == 0
    assert torch.equal(z8.dequantized(), w) and torch.equal(zs.dequantized(), w)  # exactly ggml's values
    assert z8.nbytes == n * 256 // 32 * 18  # the file's bytes: no zero points
    for tokens in (1, 2, 3, 4, 5, 8, 9, 17):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)) * tokens
        y = z8.matmul(x)
        assert torch.equal(y, zs.matmul(x)), f"{n} rows, {tokens} tokens"
        ref = q4_reference(x, w)  # fp32, the same int8 activations: only the summation order differs
        # each output against the scale of its own sum's terms (sum |x| |w|): fp32 rounding, not cancellation
        err = (y - ref).abs() / (quantize_activations(x).abs() @ w.abs().T)
        assert float(err.max()) < 1e-6, f"{n} rows, {tokens} tokens: {float(err.max())}"


def test_tail_rows_compute_the_grouped_rows_bits():
    """Rows 8..12 of a 16-row matrix (grouped lanes) against the same rows as a 5-row matrix (plain tail rows)."""
    raw = q4_0_blocks(16, 128, seed=3)
    codes, d = q4_0_codes(raw)
    full, part = Q4Matrix.from_q4_0(codes, d), Q4Matrix.from_q4_0(codes[8:13], d[8:13])
    for tokens in (1, 4, 9):
        x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
        assert torch.equal(full.matmul(x)[:, 8:13], part.matmul(x))


def test_expert_in_either_form_and_the_awq_conversion():
    """One expert (w13 [2I, H], w2 [H, I]) in both forms: the same bits, the reference within fp32 rounding; Q4_0
    experts converted to AWQ tensors (group 32, zeros 8) come back in the zero-point-free form, or in the form of
    a given ``out`` (an offloaded slot's region holds the zero points)."""
    from moeflow.engine.gguf_experts import q4_0_awq_expert_tensors  # noqa: F401  (the converter GGUF Q4_0 experts use)
    from moeflow.quant.awq import pack_int4

    H, I = 128, 96  # noqa: E741
    a8, az, aw = both_forms(2 * I, H, seed=1)
    b8, bz, bw = both_forms(H, I, seed=2)
    for tokens in (1, 5, 9):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        wt = torch.rand(tokens, generator=torch.Generator().manual_seed(7))
        y = q4_expert(x, a8, b8, wt)
        assert torch.equal(y, q4_expert(x, az, bz, wt))
        torch.testing.assert_close(y, q4_expert_reference(x, aw, bw, wt), rtol=1e-4, atol=1e-5)
    codes, d = q4_0_codes(q4_0_blocks(64, 128, seed=9))
    qweight, scales = pack_int4(codes.T.contiguous()), d.T.contiguous()
    qzeros = pack_int4(torch.full((4, 64), 8, dtype=torch.uint8))
    m = Q4Matrix.from_awq(qweight, qzeros, scales, 32)
    assert m.fmt == Q4_F16Z8 and torch.equal(m.packed, Q4Matrix.from_q4_0(codes, d).packed)
    out = Q4Matrix(torch.empty_like(m.packed), torch.empty_like(m.scales), torch.empty((64, 4), dtype=torch.uint8), 32)
    assert Q4Matrix.from_awq(qweight, qzeros, scales, 32, out=out) is out and out.fmt == Q4_F16Z
    assert torch.equal(out.dequantized(), m.dequantized())
    with pytest.raises(ValueError, match="group size 32"):
        q4_matmul(torch.randn(1, 128), m.packed, m.scales, m.mins, 64)
