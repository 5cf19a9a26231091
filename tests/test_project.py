"""Project hygiene that CI must keep: lint clean, README commands and .ci/run in step."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pip install torch==2.13.0 -e ".[test]" && python -m pytest -q' in readme
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.prefix) / "bin" / "ruff")
    result = subprocess.run([ruff, "check", "moeflow", "tests", "benchmarks", "scripts"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
