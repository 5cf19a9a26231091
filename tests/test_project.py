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


def test_readme_usage_example_runs():
    """The README's Python example, with the embedded model and the CPU in place of a hub id and CUDA."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Use", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    code = code.replace('"path/or/hub-id"', "str(embedded_model_path())").replace('device="cuda"', 'device="cpu"')
    code = code.replace("dtype=torch.float16", "dtype=torch.float32").replace("max_new_tokens=64", "max_new_tokens=8")
    from moeflow.cli import embedded_model_path

    namespace = {"embedded_model_path": embedded_model_path}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 (our own README)
    assert namespace["out"].shape[1] > namespace["enc"]["input_ids"].shape[1]
    assert namespace["logits"].dim() == 3


def test_import_restores_the_garbage_collectors_state():
    """``import moeflow`` pauses the cyclic collector while it imports, then leaves it as the caller had it."""
    probe = ("import gc, sys; was = gc.isenabled(); import moeflow; "
             "sys.exit(0 if gc.isenabled() == was and 'moeflow.api' in sys.modules else 1)")
    for setup in ("", "import gc; gc.disable(); "):
        result = subprocess.run([sys.executable, "-c", setup + probe], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"setup {setup!r}: {result.stderr[-2000:]}"
