"""Build facts of the shipped kernel configs, from the machine code (benchmarks/sass/report.py, no GPU needed):
every shipped config compiles for sm_90 with the installed Triton, nothing spills, the decode loop at Mixtral
shapes stays under 0.15 warp-instructions per 4-bit weight, the prefill loop's MMA is asynchronous, and a decode
step is at most 4 launches. Deterministic: a compiler fact, not a timing (Triton caches the builds, so a rerun
takes seconds)."""

from __future__ import annotations

import pytest
from sass_helpers import run_sass_report

DECODE_LIMIT = 0.15  # warp-instructions per weight an H100 can issue while streaming HBM (see sass/report.py)


@pytest.fixture(scope="module")
def report() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    return run_sass_report("report", "--models", "mixtral-8x7b", "--tokens", "1", "4", "16", "4096",
                           "--no-linear")


def test_every_shipped_config_compiles_without_spills(report):
    assert {r["source"] for r in report} == {"default", "table"}  # the heuristic and the shipped tables
    for r in report:
        assert r["error"] is None, r
        assert r["spill_bytes"] == 0, r
        assert r["regs"] is not None and r["regs"] <= 255, r


def test_decode_loop_instruction_economy(report):
    rows = {(r["kernel"], r["T"]): r for r in report if r["source"] == "default"}
    for T in (1, 4, 16):
        for kernel in ("w13", "w2"):
            per_weight = rows[(kernel, T)]["warp_instructions_per_weight"]
            assert per_weight is not None and per_weight <= DECODE_LIMIT, (kernel, T, per_weight)


def test_prefill_mma_is_asynchronous(report):
    for r in report:
        if r["source"] == "default" and r["T"] == 4096 and r["kernel"] in ("w13", "w2"):
            assert r["async_mma"], r


def test_decode_step_launches(report):
    for T in (1, 4, 16):
        kernels = [r["kernel"] for r in report if r["source"] == "default" and r["T"] == T]
        assert kernels[0] == "route_plan" and kernels[-1] == "combine" and len(kernels) <= 4, (T, kernels)


def test_split_w13_reduces_through_one_gpu_scope_acq_rel_atomic(report):
    """w13 split at T = 1 (the wave rule): the fixup's arrival counter is one acq_rel atomic at GPU scope (the
    release of every thread's partial, after a CTA barrier, and the acquire before the last program reads
    them); an unsplit build carries no atomic."""
    rows = {(r["kernel"], r["T"]): r for r in report if r["source"] == "default"}
    assert rows[("w13", 1)]["config"]["SPLIT_K"] > 1
    assert rows[("w13", 1)]["atomics"] == ["atom.global.gpu.acq_rel.add.u32"], rows[("w13", 1)]
    assert rows[("w13", 16)]["config"]["SPLIT_K"] == 1 and rows[("w13", 16)]["atomics"] == []


def test_every_build_fits_an_sm(report):
    """Each row says how many programs of its build an sm_90 SM holds (the waves a grid makes: the first H100
    run's decode gap); a build that fits none (too many registers or too much shared memory) fails here."""
    for r in report:
        if r["error"] is None and r["regs"] is not None:
            assert isinstance(r["programs_per_sm"], int) and r["programs_per_sm"] >= 1, r
