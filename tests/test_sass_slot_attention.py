"""Build facts of the slot decode attention kernels from their machine code (benchmarks/sass/slot_attention.py, no
GPU needed): the partial and combine launches compile for sm_90 with the installed Triton at every shipped shape
(D 64 and 128, GQA 1/4/8, sliding window, sinks; bf16 and fp32), nothing spills, each build fits an SM as often
as ``default_splits`` assumes, and the key loop stays far under the ~0.3 warp-instructions per byte of K/V at
which an H100 could no longer issue as fast as HBM streams. Deterministic compiler facts."""

from __future__ import annotations

import pytest
from sass_helpers import run_sass_report

from moeflow.kernels.attention.slot import programs_per_sm

LOOP_LIMIT = 0.15  # warp-instructions per K/V byte: half of what would cap HBM speed (seen: 0.055-0.086)


def run_report(*args: str) -> list[dict]:
    return run_sass_report("slot_attention", *args)


@pytest.fixture(scope="module")
def report() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    return run_report() + run_report("--models", "mixtral-8x7b", "gpt-oss-120b", "--dtype", "float32")


def test_every_shipped_shape_compiles_without_spills(report):
    assert len(report) == 2 * 7 and {r["kernel"] for r in report} == {"partial", "combine"}
    for r in report:
        assert r["error"] is None, r
        assert r["spill_bytes"] == 0, r
        assert r["regs"] is not None and r["regs"] <= 255, r


def test_the_bf16_partial_builds_fit_the_programs_per_sm_the_splits_assume(report):
    for r in report:
        if r["kernel"] == "partial" and r["dtype"] == "bfloat16":
            head_dim = r["config"]["BLOCK_D"]
            assert r["programs_per_sm"] >= programs_per_sm(head_dim), r
            assert r["warp_instructions_per_kv_byte"] <= LOOP_LIMIT, r
