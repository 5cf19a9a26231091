"""Build facts of the shipped MXFP4 expert kernels from their machine code (benchmarks/sass/mxfp4.py, no GPU
needed): both stages compile for sm_90 with the installed Triton at gpt-oss-120b shapes for decode and prefill
(bf16, and the fp16 activations' fp32 path), nothing spills, the decode loop stays under 0.15 warp-instructions
per weight at T = 1, 4, 16, and the prefill loop's MMA is asynchronous. Deterministic compiler facts."""

from __future__ import annotations

import pytest
from sass_helpers import run_sass_report

DECODE_LIMIT = 0.15  # warp-instructions per weight an H100 can issue while streaming HBM (see sass/report.py)


def run_report(*args: str) -> list[dict]:
    return run_sass_report("mxfp4", *args)


@pytest.fixture(scope="module")
def report() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    rows = run_report("--models", "gpt-oss-120b", "gpt-oss-20b", "--tokens", "1", "4", "16", "4096")
    return rows + run_report("--tokens", "1", "--dtype", "float16")


def test_every_shipped_config_compiles_without_spills(report):
    assert {(r["model"], r["dtype"]) for r in report} == {("gpt-oss-120b", "bfloat16"), ("gpt-oss-20b", "bfloat16"),
                                                           ("gpt-oss-120b", "float16")}
    for r in report:
        assert r["error"] is None, r
        assert r["spill_bytes"] == 0, r
        assert r["regs"] is not None and r["regs"] <= 255, r


def test_decode_loop_instruction_economy(report):
    rows = {(r["model"], r["kernel"], r["T"]): r for r in report if r["dtype"] == "bfloat16"}
    for model in ("gpt-oss-120b", "gpt-oss-20b"):
        for T in (1, 4, 16):
            for kernel in ("w13", "w2"):
                per_weight = rows[(model, kernel, T)]["warp_instructions_per_weight"]
                assert per_weight is not None and per_weight <= DECODE_LIMIT, (model, kernel, T, per_weight)


def test_prefill_mma_is_asynchronous(report):
    prefill = [r for r in report if r["T"] == 4096]
    assert len(prefill) == 4
    for r in prefill:
        assert r["async_mma"], r
