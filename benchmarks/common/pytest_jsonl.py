"""A pytest plugin for the GPU lane's correctness stage: one JSON line per test, appended the moment it ends, so a
run cut short (the stage's `timeout`, the device command's limit) still leaves machine-readable results beside the
log; the junit XML pytest writes is only complete at the end.

    MOEFLOW_TEST_JSONL=$OUT/pytest-cuda.jsonl python -m pytest -p benchmarks.common.pytest_jsonl -m cuda tests/...

Each line: ``test`` (node id), ``outcome`` (passed / failed / skipped), ``when`` (setup / call / teardown: a failing
fixture reports at setup), ``duration_s``, and ``error`` (the end of the traceback) or ``reason`` (why skipped).
"""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MOEFLOW_TEST_JSONL")
    if not path or (report.when != "call" and report.passed):
        return  # one line per test: its call, or the setup / teardown that failed or skipped it
    row = {"test": report.nodeid, "outcome": report.outcome, "when": report.when,
           "duration_s": round(report.duration, 3)}
    if report.failed:
        row["error"] = report.longreprtext[-2000:]
    elif report.skipped:
        row["reason"] = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
