"""Run one of the machine-code reports (benchmarks/sass/*.py: compile for sm_90 on this CPU) and read its lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sass_report(report: str, *args: str) -> list[dict]:
    """The JSON objects ``python -m benchmarks.sass.<report> ARGS`` prints (compiled, not interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", f"benchmarks.sass.{report}", *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
