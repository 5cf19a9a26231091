"""Build facts of the slot decode attention kernels from their machine code (benchmarks/sass_slot_attention.py, no
GPU needed): the partial and combine launches compile for sm_90 with the installed Triton at every shipped shape
(D 64 and 128, GQA 1/4/8, sliding window, sinks; bf16 and fp32), nothing spills, each build fits an SM as often
as ``default_splits`` assumes, and the key loop stays far under the ~0.3 warp-instructions per byte of K/V at
which an H100 could no longer issue as fast as HBM streams. Deterministic compiler facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.kernels.triton_slot_attention import programs_per_sm

ROOT = Path(__file__).resolve().parents[1]
LOOP_LIMIT = 0.15  # warp-instructions per K/V byte: half of what would cap HBM speed (seen: 0.055-0.086)


def run_report(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_slot_attention.py"), *args],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


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
