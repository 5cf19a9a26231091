"""Build facts of MLA's in-place decode attention kernels from their machine code (benchmarks/sass/latent_attention.py,
no GPU needed): the partial and combine launches compile for sm_90 with the installed Triton at every shipped shape
(16 / 20 / 64 / 128 heads, kv_lora_rank 512 + rope 64, DSA's selection and a wider cache row; bf16 and fp32),
nothing spills, each bf16 build fits an SM as often as ``default_splits`` assumes, and the key loop stays within
what keeps an H100 near HBM speed. Deterministic compiler facts."""

from __future__ import annotations

import pytest
from sass_helpers import run_sass_report

from moeflow.kernels.attention.latent import programs_per_sm

# warp-instructions per byte of a cache row (every head tile counted). ~0.3 would issue as fast as HBM streams;
# 128 heads are bounded by their tensor work too (~240 FLOP a latent byte): seen 0.06-0.22, 0.39-0.43 at 128 heads
ROW_BYTE_LIMIT = 0.5
PROGRAM_BYTE_LIMIT = 0.25  # per byte a program streams (seen: 0.06-0.22)


def run_report(*args: str) -> list[dict]:
    return run_sass_report("latent_attention", *args)


@pytest.fixture(scope="module")
def report() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    return run_report() + run_report("--models", "deepseek-v3", "glm-4.7-flash", "--dtype", "float32")


def test_every_shipped_shape_compiles_without_spills(report):
    assert len(report) == 2 * 8 and {r["kernel"] for r in report} == {"partial", "combine"}
    for r in report:
        assert r["error"] is None, r
        assert r["spill_bytes"] == 0, r
        assert r["regs"] is not None and r["regs"] <= 255, r


def test_the_bf16_partial_builds_fit_the_programs_per_sm_the_splits_assume(report):
    partials = [r for r in report if r["kernel"] == "partial" and r["dtype"] == "bfloat16"]
    assert {r["config"]["BLOCK_H"] for r in partials} == {16, 32, 64}
    for r in partials:
        assert r["programs_per_sm"] >= programs_per_sm(r["config"]["BLOCK_H"]), r
        assert r["warp_instructions_per_latent_byte"] <= PROGRAM_BYTE_LIMIT, r
        assert r["warp_instructions_per_row_byte"] <= ROW_BYTE_LIMIT, r
    v3 = next(r for r in partials if r["model"] == "deepseek-v3")
    assert v3["head_tiles"] == 2 and v3["programs"] == 128  # 128 heads: each latent byte read by two programs
