"""pytest plugin: every Triton launch the selected tests make is compiled for a GPU target instead of run, with the
installed Triton and its ptxas (no GPU needed; benchmarks/sass/report.py's ``compile_only``). The tests' own
outcomes are meaningless here (nothing runs); what counts is that every kernel variant they reach (constexpr
combinations: routing with the gate fused, masks, split-K, biased epilogues, MXFP4, fp16/bf16/fp32) compiles.
A Triton upgrade or downgrade (the lent GPU machines run 3.6, CI 3.9) is checked this way before a GPU session:

    TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider -p benchmarks.sass.compile_sweep \
        tests/test_kernels.py tests/test_kernels_fused.py tests/test_biased_kernels.py tests/test_mxfp4.py

SWEEP_OUT (default triton_compile_sweep.json in the working directory): one row per launch compiled (with the test that
made it); SWEEP_SM (90).
The last lines printed: launches compiled, errors, and each error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before tests/conftest.py (which only sets it when unset)
_state: dict = {}


def pytest_configure(config) -> None:
    import moeflow.kernels.experts.ops as ops
    from benchmarks.sass.report import compile_only

    ops.check_triton_device = lambda t: None  # CPU tensors stand in for device ones: they are only compiled
    context = compile_only(int(os.environ.get("SWEEP_SM", "90")))
    _state["context"], _state["found"] = context, context.__enter__()


def pytest_runtest_setup(item) -> None:
    if "found" in _state:  # the launches from here on are this test's
        _state.setdefault("starts", []).append((len(_state["found"]), item.nodeid))


def _test_of(index: int) -> str | None:
    return next((test for start, test in reversed(_state.get("starts", [])) if start <= index), None)


def pytest_unconfigure(config) -> None:
    if "context" not in _state:
        return
    _state["context"].__exit__(None, None, None)
    rows = [{"kernel": c.name, "num_warps": c.num_warps, "regs": c.regs, "spill_bytes": c.spill_bytes,
             "error": c.error, "test": _test_of(i)} for i, c in enumerate(_state["found"])]
    Path(os.environ.get("SWEEP_OUT", "triton_compile_sweep.json")).write_text(json.dumps(rows, indent=0))
    errors = [r for r in rows if r["error"]]
    kernels = sorted({r["kernel"] for r in rows})
    print(f"\ntriton compile sweep: {len(rows)} launches of {len(kernels)} kernels ({', '.join(kernels)}) compiled "
          f"for sm_{os.environ.get('SWEEP_SM', '90')}, {len(errors)} errors, max spill "
          f"{max((r['spill_bytes'] or 0 for r in rows), default=0)} bytes")
    for r in errors:
        print("ERROR", r["kernel"], r["error"][:300])
