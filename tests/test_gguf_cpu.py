"""The CPU kernels of GGUF experts (``kernels/cpu/gguf.c``: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K blocks as stored, int8
activations): each type against its fp32 plain-torch model (the activation rounding emulated, the weights
dequantized by the reference every GGUF kernel is checked against), odd row counts and token counts; a token's
result independent of the batch; the AVX-512 VNNI, AVX2 and portable builds bit for bit (an ISA this CPU lacks is
skipped with the reason); the format's CPU form (hybrid compute) and its CPU pools (``device="cpu"``). 25-45 s on
the 2 cores at load ~9 (three library builds the first time, cached after)."""

from __future__ import annotations

import pytest
import torch
from gguf_block_helpers import random_blocks, random_gguf_expert

from moeflow.engine.stored_embedding import StoredEmbedding
from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.gguf import (
    CPU_TYPES,
    DEQUANT_TYPES,
    GGUFCpuExpert,
    GGUFLinear,
    dequantize_rows,
    gguf_expert_reference,
    gguf_linear,
    gguf_linear_reference,
)
from moeflow.kernels.cpu.native import SIMD_NAMES, native_available
from moeflow.kernels.experts.gguf_reference import ggml_type
from moeflow.kernels.formats import gguf_expert_format
from moeflow.kernels.pool import ExpertPool
from moeflow.quant.ggml import dequantize
from moeflow.user_cache import cache_dir

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

TOL = 1e-5  # of the output's largest magnitude: fp32 summation order only (measured ~5e-7)
PAIRS = (("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q5_K", "Q4_K"), ("Q6_K", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_0", "Q6_K"))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = float(want.abs().max())
    assert scale > 0
    err = float((got.float() - want).abs().max())
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


def _expert(t13: str, t2: str, H: int, I: int, seed: int) -> GGUFCpuExpert:  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return GGUFCpuExpert(random_blocks(t13, I, H, g), random_blocks(t13, I, H, g), random_blocks(t2, H, I, g),
                         ggml_type(t13), ggml_type(t2))


@pytest.mark.parametrize("kind", CPU_TYPES)
def test_linear_matches_the_fp32_model(kind):
    g = torch.Generator().manual_seed(1)
    k, n = 768, 37  # three K-quant blocks per row, 24 Q8_0 blocks; a row count no tile divides
    w = random_blocks(kind, n, k, g)
    for tokens in (1, 3, 8, 9, 17):
        x = torch.randn(tokens, k, generator=g) * 3
        _close(gguf_linear(x, w, kind, k), gguf_linear_reference(x, w, kind, k))
    padded = torch.zeros(n, w.shape[1] + 40, dtype=torch.uint8)  # rows wider than the type's (a region's padding)
    padded[:, : w.shape[1]] = w
    assert torch.equal(gguf_linear(x, padded, kind, k), gguf_linear(x, w, kind, k))


@pytest.mark.parametrize(("t13", "t2"), PAIRS)
def test_expert_matches_the_fp32_model_and_the_batch(t13, t2):
    e = _expert(t13, t2, 256, 512, seed=2)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 256, generator=g), torch.rand(6, generator=g)
    y = e.forward(x, w)
    _close(y, gguf_expert_reference(e, x, w))
    one_by_one = torch.cat([e.forward(x[i : i + 1], w[i : i + 1]) for i in range(6)])
    assert torch.equal(y, one_by_one)  # a token's result does not depend on the others
    acc = torch.ones(6, 256)
    assert torch.equal(e.forward(x, w, out=acc), 1 + y) and acc is not None
    assert e.forward(x.to(torch.bfloat16), w).dtype == torch.bfloat16


def test_gguf_linear_module_is_the_kernel_and_its_fp32_model():
    """GGUFLinear (a file's K-quant lm_head on its blocks): the kernel's bits, within TOL of the fp32 model."""
    g = torch.Generator().manual_seed(4)
    w = random_blocks("Q6_K", 40, 512, g)
    head = GGUFLinear(w, "Q6_K", 512)
    x = torch.randn(2, 3, 512, generator=g)
    y = head(x)
    assert y.shape == (2, 3, 40) and head.nbytes == w.numel()
    assert torch.equal(y.reshape(6, 40), gguf_linear(x.reshape(6, 512), w, "Q6_K", 512))
    _close(y.reshape(6, 40), gguf_linear_reference(x.reshape(6, 512), w, "Q6_K", 512))
    assert head(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="this GGUF Q6_K layer takes 512"):
        head(torch.randn(1, 256))


@pytest.mark.parametrize("kind", DEQUANT_TYPES)
def test_dequantized_rows_are_ggmls_values(kind):
    """The native rows (a K-quant token embedding's lookup) are moeflow.quant.ggml's values bit for bit, padded
    rows included; StoredEmbedding over K-quant blocks looks them up."""
    w = random_blocks(kind, 9, 512, torch.Generator().manual_seed(7))
    want = dequantize(w, ggml_type(kind).type_id)
    assert torch.equal(dequantize_rows(w, kind, 512), want)
    padded = torch.zeros(9, w.shape[1] + 24, dtype=torch.uint8)
    padded[:, : w.shape[1]] = w
    assert torch.equal(dequantize_rows(padded, kind, 512), want)
    embed = StoredEmbedding(w, ggml_type(kind).type_id, 512, torch.float32, "table")
    assert embed.native
    ids = torch.tensor([[3, 0, 8], [8, 8, 1]])
    assert torch.equal(embed(ids), want[ids])
    with pytest.raises(ValueError, match="dequantize_rows takes Q4_K, Q5_K, Q6_K blocks, not Q8_0"):
        dequantize_rows(random_blocks("Q8_0", 2, 64, torch.Generator()), "Q8_0", 64)


def test_errors_name_the_types():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="Q4_1 experts have no CPU kernels: the CPU computes Q4_0, Q8_0, Q4_K"):
        gguf_linear(torch.randn(1, 256), random_blocks("Q4_1", 4, 256, g), "Q4_1", 256)
    with pytest.raises(ValueError, match="Q4_K rows of 256 inputs are 144 contiguous bytes"):
        gguf_linear(torch.randn(1, 256), torch.zeros(4, 100, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="gate .* and up .* must have the same shape"):
        GGUFCpuExpert(random_blocks("Q4_K", 8, 256, g), random_blocks("Q4_K", 4, 256, g),
                      random_blocks("Q6_K", 256, 8 * 32, g), ggml_type("Q4_K"), ggml_type("Q6_K"))


# ---- every vector ISA: the same bits ----

CACHE = cache_dir() / "cpu_native"


def _outputs(lib) -> list[torch.Tensor]:
    """Every GGUF kernel's outputs below, run on ``lib``."""
    with cpu_native.using_library(lib):
        return _all_outputs()


def _all_outputs() -> list[torch.Tensor]:
    outs = []
    for i, (t13, t2) in enumerate(PAIRS):
        e = _expert(t13, t2, 256, 256, seed=10 + i)
        for tokens in (1, 4, 9):
            x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)) * (1 + tokens)
            outs.append(e.forward(x, torch.rand(tokens, generator=torch.Generator().manual_seed(i))))
    for kind in CPU_TYPES:  # an odd row count, 1 to 7 tokens
        w = random_blocks(kind, 37, 512, torch.Generator().manual_seed(5))
        for tokens in (1, 2, 7):
            outs.append(gguf_linear(torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens)), w, kind,
                                    512))
    for kind in ("Q4_K", "Q5_K", "Q6_K"):  # the integer lanes at their bounds: every code and scale at its largest
        w = random_blocks(kind, 9, 512, torch.Generator().manual_seed(7))
        t = ggml_type(kind)
        blocks = w.view(9, -1, t.type_size)
        fields = torch.zeros(t.type_size, dtype=torch.bool)
        for off in (0, 2) if kind != "Q6_K" else (208,):
            fields[off : off + 2] = True
        blocks[..., ~fields] = 0xFF if kind != "Q6_K" else 0x7F  # Q6_K: scales 127 (int8), codes 63 or 31
        g = torch.Generator().manual_seed(8)
        for x in (torch.ones(1, 512), -torch.ones(3, 512), torch.randn(1, 512, generator=g),
                  torch.randn(3, 512, generator=g)):
            outs.append(gguf_linear(x, w, kind, 512))
    for kind in DEQUANT_TYPES:
        outs.append(dequantize_rows(random_blocks(kind, 5, 512, torch.Generator().manual_seed(6)), kind, 512))
    return outs


@pytest.mark.parametrize(("isa", "want"), [("native", 2), ("avx2", 1)])
def test_each_isa_gives_the_portable_bits(isa, want):
    lib = cpu_native.load(cpu_native.build(CACHE, isa=isa))
    if lib.mf_simd() < want:
        pytest.skip(f"this CPU has no {SIMD_NAMES[want]} (the {isa} build runs {SIMD_NAMES[lib.mf_simd()]}): its "
                    "GGUF kernels are not tested here")
    portable = cpu_native.load(cpu_native.build(CACHE, isa="baseline"))
    if portable.mf_simd() != 0:
        pytest.skip("this compiler enables AVX2 by default: no portable build to compare")
    got, ref = _outputs(lib), _outputs(portable)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


# ---- the format's CPU form and CPU pools ----

def test_format_cpu_form_and_cpu_pools_agree():
    fmt = gguf_expert_format("Q4_K", ("Q6_K", "Q4_K"), 256, 256, torch.float32)
    assert fmt.cpu_unsupported() is None and not fmt.cpu_kernels
    cpu = fmt.with_cpu_kernels()
    assert cpu.cpu_kernels and cpu.nbytes == fmt.nbytes
    g = torch.Generator().manual_seed(5)
    experts = [random_gguf_expert(fmt, g, "Q4_K", down) for down in ("Q6_K", "Q4_K", "Q6_K")]
    pool = ExpertPool.allocate(cpu, 3, "cpu")
    for slot, t in enumerate(experts):
        cpu.write(pool.buffer[slot], t)
    x = torch.randn(5, 256, generator=g)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    w = torch.rand(5, 2, generator=g)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)  # expert e in slot slots[e]
    out = torch.zeros(10, 256)
    cpu.forward(x, ids, w, pool, slots, out, None, "torch")
    ref = torch.zeros(10, 256)
    fmt.forward(x, ids, w, ExpertPool(fmt, pool.buffer), slots, ref, None, "torch")  # the fp32 reference
    flat = ids.reshape(-1)
    for e in range(3):
        pairs = torch.nonzero(flat == e).squeeze(1)
        form = fmt.cpu_expert(fmt.loader_tensors(pool.buffer[int(slots[e])]))  # hybrid compute's form
        assert torch.equal(out[pairs], form.forward(x[pairs // 2], w.reshape(-1)[pairs]))
    assert float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())  # int8 activations vs fp32 (random blocks)
    assert not torch.equal(out, ref)  # the CPU kernels ran, not the reference


def test_types_without_cpu_kernels_are_named():
    fmt = gguf_expert_format("Q4_1", "Q6_K", 256, 256, torch.float32)
    assert "GGUF Q4_1 blocks, which have no CPU kernels" in fmt.cpu_unsupported()
    with pytest.raises(ValueError, match="cannot use the CPU kernels: .*Q4_1"):
        fmt.with_cpu_kernels()
    with pytest.raises(ValueError, match="no CPU form for these GGUF experts: .*Q4_1"):
        fmt.cpu_expert(random_gguf_expert(fmt, torch.Generator().manual_seed(0)))
