"""The load-time qweight conversions that move packed words (moeflow/kernels/repack.py, cpu_repack.c) against the
unpacking references they replace: bit for bit, on both implementations (C and plain torch) and on the portable
C build (no AVX-512). ~3 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

from moeflow.kernels import repack
from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, pack_q4
from moeflow.kernels.formats import expert_format
from moeflow.kernels.formats.plain_layout import awq_panel, to_kernel_layout, to_kernel_layout_reference
from moeflow.quant.awq import unpack_int4

# (K, N, group): C = N/8 words per row not a multiple of 16 (the vector loop's tail), several panels, group 32
SHAPES = [(64, 128, 32), (256, 160, 64), (128, 256, 128), (384, 1024, 128), (96, 64, 32)]


def words(k: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.fixture(params=["native", "torch"])
def lib(request):
    """moeflow's CPU library (the C converters), or None (the plain-torch twin)."""
    if request.param == "torch":
        return None
    if not cpu_native.native_available():
        pytest.skip("moeflow's CPU library does not build here")
    return cpu_native.library()


@pytest.mark.parametrize("k,n,group", SHAPES)
def test_panels_equal_the_unpacking_reference(lib, k, n, group):
    q = words(k, n, k + n)
    for name in ("w13_qweight", "w2_qweight"):
        ref = to_kernel_layout_reference(name, q, n // 2, group)
        got = repack.awq_to_panels(q, awq_panel(group), interleave=name.startswith("w13"), lib=lib)
        assert torch.equal(got, ref), name
        assert torch.equal(to_kernel_layout(name, q, n // 2, group), ref)


@pytest.mark.parametrize("k,n,group", SHAPES)
def test_q4_rows_equal_the_unpacking_reference(lib, k, n, group):
    q = words(k, n, 7 * k + n)
    ref = pack_q4(unpack_int4(q).T.to(torch.uint8))
    out = torch.full_like(ref, 0xAB)
    assert torch.equal(repack.awq_to_q4_packed(q, out=out, lib=lib), ref)


def test_portable_c_build_gives_the_same_bytes(tmp_path):
    """The scalar C loops (no AVX-512 at the baseline ISA) against the references."""
    lib = cpu_native.load(cpu_native.build(tmp_path, native_arch=False))
    for k, n, group in SHAPES[:3]:
        q = words(k, n, 3 * k + n)
        assert torch.equal(repack.awq_to_panels(q, awq_panel(group), True, lib=lib),
                           to_kernel_layout_reference("w13_qweight", q, n // 2, group))
        assert torch.equal(repack.awq_to_q4_packed(q, lib=lib), pack_q4(unpack_int4(q).T.to(torch.uint8)))


def test_expert_region_round_trips_and_cpu_form_converts_in_place():
    """ExpertFormat.write (fast qweights) is still exactly inverted by loader_tensors; Int4Expert converted into a
    region's views equals the one converted on its own."""
    H, I, g = 128, 64, 32  # noqa: E741
    fmt = expert_format(H, I, "awq", torch.float16, g)
    gen = torch.Generator().manual_seed(1)
    t = {name: (torch.rand(shape, generator=gen).half() if name.endswith("scales")
                else torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32))
         for name, shape in fmt.loader_shapes().items()}
    region = torch.empty(fmt.nbytes, dtype=torch.uint8)
    fmt.write(region, t)
    back = fmt.loader_tensors(region)
    assert all(torch.equal(back[name], t[name]) for name in t)
    if not cpu_native.native_available():
        return
    from moeflow.offload.cpu_slots import CpuInt4Format

    cpu = CpuInt4Format.of(fmt)
    region = torch.full((cpu.nbytes,), 0xCD, dtype=torch.uint8)
    cpu.write(region, t)
    fresh = Int4Expert.from_awq_tensors(t, g)
    held = cpu.int4_expert(region)
    for a, b in ((fresh.w13, held.w13), (fresh.w2, held.w2)):
        assert isinstance(a, Q4Matrix)
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="int32"):
        repack.awq_to_panels(torch.zeros(64, 4, dtype=torch.int64), 32, False)  # (int64 words)
    with pytest.raises(ValueError, match="out must be"):
        repack.awq_to_q4_packed(torch.zeros(64, 4, dtype=torch.int32), out=torch.empty(32, 16, dtype=torch.uint8))


def test_mxfp4_bit_permutation_native_equals_torch(monkeypatch):
    """MXFP4 blocks into the kernel layout: the C pass (8-bit tables) against torch's 16-bit table lookups."""
    if not cpu_native.native_available():
        pytest.skip("moeflow's CPU library does not build here")
    from moeflow.kernels.experts.mxfp4_reference import from_kernel_layout, to_kernel_layout

    blocks = torch.randint(0, 256, (40, 6, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    fast = to_kernel_layout(blocks)
    monkeypatch.setattr(repack, "permute_word_bits_native", lambda *a: None)  # torch's lookups
    assert torch.equal(fast, to_kernel_layout(blocks))
    assert torch.equal(from_kernel_layout(fast), blocks)


def test_int8_row_quantization_native_equals_torch():
    """The lm_head's int8 quantization in C against the torch expression it replaces (rows of mixed scales, an
    all-zero row, exact halves)."""
    if not cpu_native.native_available():
        pytest.skip("moeflow's CPU library does not build here")
    from moeflow.kernels.cpu.quant_linear import COMPUTE_DTYPE, INT8_MAX

    g = torch.Generator().manual_seed(2)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-6, 2, 37)[:, None]
    w[3] = 0.0
    w[5, :8] = torch.arange(8) + 0.5
    q, s = repack.quantize_rows_int8_native(cpu_native.library(), w)
    want_s = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-8).to(COMPUTE_DTYPE)
    want_q = torch.round(w / want_s.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)
