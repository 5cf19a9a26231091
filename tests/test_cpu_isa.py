"""moeflow's CPU kernels built for each vector ISA the machine has (AVX-512 VNNI, AVX2, portable C) give the same
bits: the same int8 activations, integer block sums exact in int32 whatever the instruction (vpdpbusd, maddubs,
C), and the same fp32 operations per output row in the same order. An ISA this CPU lacks is skipped with the
reason printed; the AVX2 build (``-march=native -mno-avx512f``, ``MOEFLOW_CPU_ISA=avx2``) is the path of an
AVX2-only machine, tested here on an AVX-512 one. The kernels: q4, q8, the q4 expert and the native MXFP4 expert
(mxfp4.c; on AVX-512 VBMI machines its two-row decode; both gate activations, f32 / f16 / bf16 biases, nan / inf
inputs). ~10 s on the loaded 2-core EPYC (three builds, cached)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.native import SIMD_NAMES, native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, group_rows, pack_q4, q4_expert
from moeflow.kernels.cpu.q8_matrix import Q8Matrix
from moeflow.user_cache import cache_dir

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

CACHE = cache_dir() / "cpu_native"
WANT = {"native": 2, "avx2": 1}  # the mf_simd() each build must reach to be the path under test


def _lib(isa: str):
    lib = cpu_native.load(cpu_native.build(CACHE, isa=isa))
    got = lib.mf_simd()
    if got < WANT[isa]:
        pytest.skip(f"this CPU has no {SIMD_NAMES[WANT[isa]]} (the {isa} build runs {SIMD_NAMES[got]}): "
                    f"its kernels are not tested here")
    return lib


def _run(lib, fn):
    with cpu_native.using_library(lib):
        return fn()


def _q4(n: int, k: int, group: int, seed: int, half: bool, zero8: bool = False) -> Q4Matrix:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-4).half()
    z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    rows = group_rows
    if zero8:  # GGUF Q4_0's form (group 32, no zero points stored)
        return Q4Matrix.from_q4_0(q, s)
    if half:
        return Q4Matrix(pack_q4(q), rows(s), rows(z), group)
    return Q4Matrix(pack_q4(q), rows(s.float()), rows(-z.float() * s.float()), group)


def _cases(x_k: int, fn_of_x, tokens=(1, 2, 3, 4, 5, 8, 9, 17)):
    out = []
    for t in tokens:
        x = torch.randn(t, x_k, generator=torch.Generator().manual_seed(t)) * (1 + t)
        out.append(fn_of_x(x))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape
        assert torch.equal(u.view(torch.int32), v.view(torch.int32)), float((u - v).abs().max())


def _all_kernels() -> list[torch.Tensor]:
    """Every kernel on shapes that take each path: 16-row pairs (q8 always, q4 from 4 tokens), a lone 8-row
    group, plain tail rows, both q4 forms, every token tile, the q8 rows picked by index, the expert."""
    res = []
    for n, half in ((8 * 7 + 5, True), (8 * 6, False), (8, True), (24 + 3, False)):  # odd/even groups, tails
        m = _q4(n, 256, 64, seed=n, half=half)
        res += _cases(256, m.matmul)
    for n, half, zero8 in ((8 * 5 + 3, True, True), (8 * 4, True, False), (16 + 5, False, False)):  # group 32
        res += _cases(256, _q4(n, 256, 32, seed=n, half=half, zero8=zero8).matmul)
    g = torch.Generator().manual_seed(3)
    for n in (51, 64, 8, 24):
        q = torch.randint(-127, 128, (n, 128), generator=g, dtype=torch.int8)
        q[0, :32], q[-1, -32:] = 127, -127
        m8 = Q8Matrix.from_rows(q, torch.rand(n, generator=g))
        res += _cases(128, m8.matmul)
        res += _cases(128, lambda x, m8=m8, n=n: m8.matmul_rows(x, torch.tensor([n - 1, 0, n // 2])), (1, 3))
    H, I, G = 128, 96, 32  # noqa: E741
    w13, w2 = _q4(2 * I, H, G, seed=1, half=True), _q4(H, I, G, seed=2, half=True)
    res += _cases(H, lambda x: q4_expert(x, w13, w2, torch.rand(x.shape[0], generator=g)), (1, 5, 9))
    w13, w2 = _q4(2 * I, H, G, seed=3, half=True, zero8=True), _q4(H, I, G, seed=4, half=True, zero8=True)
    res += _cases(H, lambda x: q4_expert(x, w13, w2, torch.rand(x.shape[0], generator=g)), (1, 9))
    return res + _mxfp4_kernels()


# (H, I, bias dtype or None, activation): 64-input panels (128, 64) and 32-input panels with an odd number of
# blocks (96 = 3, 160 = 5); both gate activations with each bias dtype, and no bias
MXFP4_CASES = ((128, 64, torch.bfloat16, "clamped_swiglu"), (96, 160, torch.bfloat16, "silu"),
               (64, 96, torch.float16, "clamped_swiglu"), (96, 64, torch.float16, "silu"),
               (160, 96, torch.float32, "clamped_swiglu"), (64, 128, torch.float32, "silu"),
               (96, 64, None, "clamped_swiglu"))


def _mxfp4_rows(t: int, k: int) -> torch.Tensor:
    """t rows of k inputs, row r scaled by 0.1 x 4^(r mod 4): gate inputs where sigmoid is not yet 1 (an fp32
    rounding of the epilogue changes an int8 block of the down projection) and beyond the SwiGLU clamp; from 8
    tokens on, rows 1-4 hold a nan, a +inf, a -inf and an all-zero block of 32 (the int8 scale's special cases)."""
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * (0.1 * 4.0 ** (torch.arange(t) % 4))[:, None]
    if t >= 8:
        x[1, 5], x[2, 7], x[3, k - 9], x[4, 32:64] = float("nan"), float("inf"), -float("inf"), 0.0
    return x


def _mxfp4_kernels() -> list[torch.Tensor]:
    """The native MXFP4 expert (mxfp4.c, mxfp4_epilogue.c) on the region layout: MXFP4_CASES at 1, 3, 4, 8, 9
    tokens (every token tile and tail, the nan / inf / zero rows), added into an ``out`` too; the down matrix
    alone. The special rows' documented results are asserted on each build: a nan input reads as 0 (max|x| skips
    it, its code is 0), an infinite one makes its token's gate row nan (code 0 times xs = inf), which the down
    projection's int8 activations read as zeros (SiLU: the output is bias2 x weight; the clamped SwiGLU's min / max
    keep the limit), so every output is finite."""
    from test_cpu_mxfp4_native import expert_tensors, odd_row_matrices

    from moeflow.kernels.formats import biased_expert_format

    res = []
    for i, (H, I, dtype, act) in enumerate(MXFP4_CASES):  # noqa: E741
        fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=dtype or torch.float32,
                                   activation=act, bias=dtype is not None)
        tensors = expert_tensors(H, I, dtype, dtype is not None, seed=40 + i)
        expert = fmt.cpu_expert(tensors)
        for t in (1, 3, 4, 8, 9):
            x, w = _mxfp4_rows(t, H), torch.rand(t, generator=torch.Generator().manual_seed(t))
            y = expert.forward(x, w)
            assert y.isfinite().all()
            if t >= 8:
                x0 = x.clone()
                x0[1, 5] = 0.0
                assert torch.equal(expert.forward(x0, w)[1], y[1])
                if act == "silu":
                    b2 = tensors["w2_bias"].float() if dtype is not None else torch.zeros(H)
                    assert torch.equal(y[2:4], b2 * w[2:4, None])
            acc = torch.randn(t, H, generator=torch.Generator().manual_seed(99))
            res += [y, expert.forward(x, w, out=acc), expert.w2.matmul(_mxfp4_rows(t, I))]
    for m in odd_row_matrices():  # the tails of the 8-row and two-row loops, a matrix split into row tiles
        res += [m.matmul(_mxfp4_rows(t, m.k)) for t in (1, 5)]
    return res


def test_avx512_and_avx2_kernels_give_the_same_bits():
    native, avx2 = _lib("native"), _lib("avx2")
    _same(_run(native, _all_kernels), _run(avx2, _all_kernels))


def test_avx2_and_portable_q8_give_the_same_bits():
    """The q8 kernel's portable loops do the AVX2 lanes' operations (fmaf per block): the same bits too; so do
    the q4 kernel's at group 32 with integer zero points (one fmaf per block)."""
    avx2 = _lib("avx2")
    base = cpu_native.load(cpu_native.build(CACHE, isa="baseline"))
    if base.mf_simd():
        pytest.skip("this compiler enables AVX2 by default: no portable build to compare")
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (51, 128), generator=g, dtype=torch.int8)
    m8 = Q8Matrix.from_rows(q, torch.rand(51, generator=g))
    run = lambda: _cases(128, m8.matmul)  # noqa: E731
    _same(_run(avx2, run), _run(base, run))
    # the q4 kernel at group 32 with integer zero points: the portable loops do the lanes' operations too
    z8, zs = _q4(8 * 3 + 5, 128, 32, seed=5, half=True, zero8=True), _q4(8 * 2 + 3, 128, 32, seed=6, half=True)
    run = lambda: _cases(128, z8.matmul) + _cases(128, zs.matmul)  # noqa: E731
    _same(_run(avx2, run), _run(base, run))
    # the native MXFP4 expert: the portable loops form the same word sums and fused multiply-adds
    _same(_run(avx2, _mxfp4_kernels), _run(base, _mxfp4_kernels))


def test_isa_is_chosen_by_the_environment_and_named():
    """MOEFLOW_CPU_ISA picks the build (a cache key of its own); a wrong value is named."""
    code = "from moeflow.kernels.cpu.int4 import cpu_expert_kernel; print(cpu_expert_kernel())"
    env = {**os.environ, "MOEFLOW_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[2] in ("avx2", "scalar")
    assert cpu_native.build(CACHE, isa="avx2") != cpu_native.build(CACHE, isa="native")
    with pytest.raises(ValueError, match="MOEFLOW_CPU_ISA"):
        cpu_native.build(CACHE, isa="avx1024")
