"""moeflow's own CPU kernels (moeflow/kernels/cpu/native.c) against their plain-torch fp32 models."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.matrix_reference import q4_expert_reference, q4_reference, quantize_activations
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4_F16Z, Q4_F32, Q4Matrix, group_rows, pack_q4, q4_expert, unpack_q4
from moeflow.kernels.cpu.q8_matrix import Q8Matrix
from moeflow.quant.awq import dequantize, quantize_rtn

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

# kernel vs its model: the same int8 activations and weights, integer block sums exact; only the fp32 summation
# order across blocks and groups differs (~1e-6 relative)
NATIVE_RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def q4(n: int, k: int, group: int, seed: int) -> tuple[Q4Matrix, torch.Tensor]:
    t = quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, group)
    return Q4Matrix.from_awq(t.qweight, t.qzeros, t.scales, group), \
        dequantize(t.qweight, t.qzeros, t.scales.float(), group).T


def q4_any_rows(n: int, k: int, group: int, seed: int) -> tuple[Q4Matrix, torch.Tensor]:
    """A random q4 matrix with any row count (AWQ packing needs multiples of 8; the kernel's tail rows do not)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s, m = torch.rand(n, k // group, generator=g) * 0.01, -torch.rand(n, k // group, generator=g) * 0.08
    w = q.float() * s.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
    return Q4Matrix(pack_q4(q), group_rows(s), group_rows(m), group), w


def q4_both_forms(n: int, k: int, group: int, seed: int) -> tuple[Q4Matrix, Q4Matrix]:
    """One random q4 matrix (fp16 scales, any row count) in both forms: (Q4_F32, Q4_F16Z)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-4).half()
    z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    packed, rows = pack_q4(q), group_rows
    return (Q4Matrix(packed, rows(s.float()), rows(-z.float() * s.float()), group),
            Q4Matrix(packed, rows(s), rows(z), group))


def test_compact_form_gives_the_fp32_forms_results_bit_for_bit():
    """fp16 scales with uint8 zeros (Q4_F16Z) against fp32 scales and mins (Q4_F32) of the same weights: every
    token tile, the plain tail rows, the expert, fused rows of both forms; 3 instead of 8 bytes per group. (At
    group 32 the integer zero points are folded into the block sums instead: tests/test_cpu_q4_group32.py.)"""
    f32, f16 = q4_both_forms(8 * 5 + 5, 256, 64, seed=40)
    assert (f32.fmt, f16.fmt) == (Q4_F32, Q4_F16Z)
    assert torch.equal(f16.dequantized(), f32.dequantized()) and f16.fp32_form().scales.dtype == torch.float32
    assert f32.nbytes - f16.nbytes == 5 * f32.scales.numel()
    for tokens in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        assert torch.equal(f16.matmul(x), f32.matmul(x))
    g32, g16 = q4_both_forms(40, 256, 64, seed=45)  # whole row groups: the fused rows computed as before
    fused = Q4Matrix.concat_rows([g16, g32])  # mixed forms: the fp32 one
    assert fused.fmt == Q4_F32 and torch.equal(fused.matmul(x), torch.cat([g32.matmul(x)] * 2, 1))
    assert Q4Matrix.concat_rows([g16, g16]).fmt == Q4_F16Z
    H, I, G = 128, 192, 64  # noqa: E741
    a32, a16 = q4_both_forms(2 * I, H, G, seed=41)
    b32, b16 = q4_both_forms(H, I, G, seed=42)
    x, w = torch.randn(5, H, generator=torch.Generator().manual_seed(43)), torch.rand(5)
    assert torch.equal(q4_expert(x, a16, b16, w), q4_expert(x, a32, b32, w))
    assert torch.equal(q4_expert(x, a16, b32, w), q4_expert(x, a32, b32, w))  # mixed: both taken as fp32
    # from AWQ tensors: fp16 scales take the compact form (or not, when asked); the same results
    t = quantize_rtn(torch.randn(64, 128, generator=torch.Generator().manual_seed(44)) * 0.05, 64)
    c, p = Q4Matrix.from_awq(t.qweight, t.qzeros, t.scales, 64), Q4Matrix.from_awq(t.qweight, t.qzeros,
                                                                                    t.scales.float(), 64)
    assert (c.fmt, p.fmt) == (Q4_F16Z, Q4_F32)
    assert torch.equal(c.matmul(x[:, :128]), p.matmul(x[:, :128]))
    assert Q4Matrix.from_awq(t.qweight, t.qzeros, t.scales, 64, compact=False).fmt == Q4_F32
    with pytest.raises(ValueError, match="not all fp16"):
        Q4Matrix.from_awq(t.qweight, t.qzeros, t.scales.float() * (1 + 1e-6), 64, compact=True)


@pytest.mark.parametrize("n,k,group,tokens", [(64, 128, 32, 1), (96, 256, 64, 3), (80, 256, 128, 9),
                                              (1032, 512, 128, 5)])
def test_q4_matmul_matches_its_reference(n, k, group, tokens):
    m, w = q4(n, k, group, seed=tokens)
    assert torch.equal(m.dequantized(), w)  # the format holds AWQ's weights exactly
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    y = m.matmul(x)
    assert y.shape == (tokens, n) and y.dtype == torch.float32
    assert rel(y, q4_reference(x, w)) < NATIVE_RTOL
    assert rel(y, x @ w.T) < 2e-2  # the int8 activations' own error against exact fp32


@pytest.mark.parametrize("tokens", range(1, 34))
def test_q4_every_token_count_and_row_tail(tokens):
    """The token tiles (4 at a time, then 1..3) and the plain tail rows (N % 8) at every T from 1 to 33."""
    m, w = q4_any_rows(8 * 5 + 5, 256, 64, seed=tokens)
    assert torch.equal(m.dequantized(), w)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
    y = m.matmul(x)
    assert rel(y, q4_reference(x, w)) < NATIVE_RTOL
    # every row checked, not only the norm: a wrong tile or tail shows up as one wrong column
    err = (y - q4_reference(x, w)).abs().amax(0) / q4_reference(x, w).abs().amax(0).clamp_min(1e-6)
    assert float(err.max()) < 1e-4


def test_q4_layout_round_trips_and_keeps_row_groups_as_slices():
    m, w = q4_any_rows(8 * 3 + 3, 128, 32, seed=11)
    assert m.packed.shape == (27, 64) and m.scales.shape == (27, 4)
    assert torch.equal(unpack_q4(pack_q4(torch.arange(16).repeat(27, 8).to(torch.uint8))),
                       torch.arange(16).repeat(27, 8).to(torch.uint8))
    assert torch.equal(group_rows(group_rows(m.scales), inverse=True), m.scales)
    # rows 8..16 of the matrix are rows 8..16 of every tensor: a slice the kernel reads as a matrix of its own
    part = Q4Matrix(m.packed[8:16], m.scales[8:16], m.mins[8:16], 32)
    assert torch.equal(part.dequantized(), w[8:16])


def test_concat_rows_is_the_matrix_of_the_stacked_rows():
    """q, k, v fused into one matrix: aligned parts by plain concatenation, others re-grouped."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(12))
    for rows in ((16, 8, 8), (13, 8, 5), (8, 3)):
        parts = [q4_any_rows(n, 128, 32, seed=20 + i) for i, n in enumerate(rows)]
        fused = Q4Matrix.concat_rows([m for m, _ in parts])
        w = torch.cat([w for _, w in parts])
        assert torch.equal(fused.dequantized(), w)
        assert rel(fused.matmul(x), q4_reference(x, w)) < NATIVE_RTOL
    with pytest.raises(ValueError, match="in_features"):
        Q4Matrix.concat_rows([q4_any_rows(8, 128, 32, 0)[0], q4_any_rows(8, 64, 32, 0)[0]])


def q8_codes(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 rows [n, k] in [-127, 127] (the extremes included) and fp32 row scales [n]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :32], q[-1, -32:] = 127, -127  # a block of the largest products: maddubs' pairs must not saturate
    return q, torch.rand(n, generator=g)


@pytest.mark.parametrize("n,k,tokens", [(70, 256, 6), (64, 128, 1), (5, 64, 2), (8, 32, 4), (1032, 512, 9),
                                        (48, 256, 33)])
def test_q8_matmul_matches_its_reference(n, k, tokens):
    q, s = q8_codes(n, k, seed=tokens)
    m = Q8Matrix.from_rows(q, s)
    w = q.float() * s[:, None]
    assert torch.equal(m.dequantized(), w)  # the layout holds the codes exactly (8-row groups, plain tail rows)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = torch.linspace(-1, 1, 32).sign() * 3.0  # +-127 activations against the +-127 weights above
    y = m.matmul(x)
    assert y.shape == (tokens, n) and y.dtype == torch.float32
    assert rel(y, q4_reference(x, w)) < NATIVE_RTOL
    assert rel(y, x @ w.T) < 2e-2


def test_q8_rows_are_bit_identical_however_computed():
    """A row's logit is the same bits in a row group, in the plain tail, in a matrix of a few gathered rows and
    in any batch: the int4 lm_head's recomputed candidates rely on it (kernels/cpu/lm_head.py)."""
    q, s = q8_codes(45, 256, seed=3)  # 5 groups of 8 and 5 tail rows
    m = Q8Matrix.from_rows(q, s)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(4))
    full = m.matmul(x)
    for t in (0, 3, 6):
        assert torch.equal(m.matmul(x[t:t + 1]), full[t:t + 1])
    for ids in ([3, 41, 17, 40, 0, 9, 33, 44, 12], [42], [1, 2, 43]):  # rows moved between groups and the tail
        ids = torch.tensor(ids)
        part = Q8Matrix.from_rows(m.rows(ids), s[ids])
        assert torch.equal(part.matmul(x), full[:, ids])
        assert torch.equal(m.matmul_rows(x, ids), full[:, ids])  # read in place, one row at a time
    with pytest.raises(IndexError, match="45 rows"):
        m.matmul_rows(x, torch.tensor([45]))


def test_q8_matrix_rows_and_concatenation():
    q, s = q8_codes(45, 128, seed=5)
    m = Q8Matrix.from_rows(q, s)
    ids = torch.tensor([[44, 0], [7, 8], [40, 39]])
    assert torch.equal(m.rows(ids), q[ids])
    assert torch.equal(Q8Matrix.from_rows(q[:40], s[:40]).rows(ids[:, 1]), q[ids[:, 1]])
    for rows in ([16, 29], [24, 8, 13], [5, 16]):  # slices of the groups; else the rows re-grouped
        parts = [Q8Matrix.from_rows(*q8_codes(n, 128, seed=30 + i)) for i, n in enumerate(rows)]
        fused = Q8Matrix.concat_rows(parts)
        assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
        x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6))
        assert torch.equal(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=1))
    with pytest.raises(ValueError, match="in_features"):
        Q8Matrix.concat_rows([m, Q8Matrix.from_rows(*q8_codes(8, 64, seed=0))])


def test_activation_quantization_model():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    x[1, :32] = 0.0  # an all-zero block quantizes to zeros, not NaN
    xq = quantize_activations(x)
    assert torch.equal(xq[1, :32], torch.zeros(32))
    step = x.reshape(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((xq - x).reshape(3, 2, 32).abs() <= step / 2 + 1e-7).all())


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 16, 17, 33])
def test_expert_matches_its_reference_and_accumulates(tokens):
    H, I, G, T = 128, 96, 32, tokens  # noqa: E741
    w13, d13 = q4(2 * I, H, G, seed=0)
    w2, d2 = q4(H, I, G, seed=1)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, generator=g)
    y = q4_expert(x, w13, w2, w)
    assert rel(y, q4_expert_reference(x, d13, d2, w)) < NATIVE_RTOL
    base = torch.randn(T, H, generator=g)
    out = base.clone()
    assert q4_expert(x, w13, w2, w, out) is out
    assert torch.equal(out, base + y)  # out += w * y, the same numbers as adding the result


def test_vectorized_silu_is_the_scalar_loop_bit_for_bit():
    """The expert's silu(gate) * up: 8 lanes at a time (AVX2, its own expf) against the scalar loop with libm's
    expf, bit for bit, on random bit patterns (every exponent, inf, nan, denormals), log-uniform magnitudes up to
    88 (expf's main path), activation-like values and the path's edges, with a tail shorter than 8. (Every float:
    benchmarks/peers/cpu_expf_check.c.)"""
    lib = cpu_native.library()
    for f in (lib.mf_silu_mul, lib.mf_silu_mul_scalar):
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        f.restype = None
    g = torch.Generator().manual_seed(12)
    edges = torch.tensor([0.0, -0.0, 88.0, -88.0, 87.99, -87.99, 88.73, -103.9, -104.0, 1e-40, -1e-40,
                          float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 0.5, 1e-8])
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32)
    sign = torch.randint(0, 2, (1 << 20,), generator=g) * 2 - 1.0
    log_uniform = sign * torch.exp(torch.rand(1 << 20, generator=g, dtype=torch.float64) * 74 - 69).float()  # to 88
    gate = torch.cat([bits, log_uniform, torch.randn(1 << 16, generator=g) * 6, torch.linspace(-110, 110, 40003),
                      edges])
    up = torch.randn(gate.numel(), generator=g)
    fast, slow = torch.empty_like(gate), torch.empty_like(gate)
    lib.mf_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), fast.data_ptr())
    lib.mf_silu_mul_scalar(gate.data_ptr(), up.data_ptr(), gate.numel(), slow.data_ptr())
    nan = slow.isnan()
    assert torch.equal(fast.isnan(), nan)
    assert torch.equal(fast[~nan].view(torch.int32), slow[~nan].view(torch.int32))
    assert gate.numel() % 8 and int(nan.sum()) < gate.numel() // 100


def test_a_tokens_result_does_not_depend_on_the_batch():
    """Every output row depends only on its own token: batched prefill and one-token decode agree bit for bit."""
    H, I, G = 256, 128, 64  # noqa: E741
    w13, _ = q4(2 * I, H, G, seed=3)
    w2, _ = q4(H, I, G, seed=4)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    w = torch.rand(9, generator=torch.Generator().manual_seed(6))
    batched = q4_expert(x, w13, w2, w)
    for t in (0, 4, 8):
        assert torch.equal(q4_expert(x[t:t + 1], w13, w2, w[t:t + 1]), batched[t:t + 1])
    assert torch.equal(w13.matmul(x[5:6]), w13.matmul(x)[5:6])


def test_portable_build_gives_the_same_results(tmp_path):
    """The plain C loops (machines without AVX2) against the same reference."""
    lib = cpu_native.load(cpu_native.build(tmp_path, native_arch=False))
    if lib.mf_simd():
        pytest.skip("this compiler enables AVX2 by default: no portable build to test")
    with cpu_native.using_library(lib):
        m, w = q4_any_rows(67, 256, 64, seed=7)  # 8 row groups and 3 plain tail rows
        for tokens in (1, 2, 5, 9):
            x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(8))
            assert rel(m.matmul(x), q4_reference(x, w)) < NATIVE_RTOL
        q, s = q8_codes(51, 128, seed=9)  # 6 row groups and 3 tail rows
        m8 = Q8Matrix.from_rows(q, s)
        assert rel(m8.matmul(x[:, :128]), q4_reference(x[:, :128], q.float() * s[:, None])) < NATIVE_RTOL
        ids = torch.tensor([50, 3, 9])
        assert torch.equal(Q8Matrix.from_rows(m8.rows(ids), s[ids]).matmul(x[:, :128]), m8.matmul(x[:, :128])[:, ids])
        f32, f16 = q4_both_forms(67, 256, 64, seed=10)  # the compact form's scalar loads
        assert torch.equal(f16.matmul(x), f32.matmul(x))
        assert torch.equal(m8.matmul_rows(x[:, :128], ids), m8.matmul(x[:, :128])[:, ids])


def test_switched_off_falls_back_to_torchs_kernels():
    code = ("from moeflow.kernels.cpu.native import native_available; from moeflow.kernels.cpu.int4 import "
            "cpu_expert_kernel; print(native_available(), cpu_expert_kernel())")
    env = {**os.environ, "MOEFLOW_CPU_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "False" and "torch int4" in out


def test_bad_shapes_are_named():
    t = quantize_rtn(torch.randn(32, 64), 32)
    with pytest.raises(ValueError, match="group_size"):
        Q4Matrix.from_awq(t.qweight, t.qzeros, t.scales, 48)  # the kernel's activation blocks are 32 wide
    with pytest.raises(ValueError, match="in_features"):
        Q8Matrix.from_rows(torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="one per row"):
        Q8Matrix.from_rows(torch.zeros(8, 64, dtype=torch.int8), torch.ones(4))


def test_each_loaded_library_gets_a_binding_modules_signatures_once():
    """native.declared: once per library object, again for a new one (the three binding modules once kept an id()
    set, which a later library could match after a freed one: it then ran without signatures and crashed)."""
    import ctypes

    from moeflow.kernels.cpu.native import declared

    calls = []
    first, second = ctypes.CDLL(None), ctypes.CDLL(None)
    for lib in (first, first, second):
        assert declared(lib, calls.append) is lib
    assert calls == [first, second]
