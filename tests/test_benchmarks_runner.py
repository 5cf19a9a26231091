"""The benchmarks package's runner (``python -m benchmarks``) and the commands that name its modules: every
``python -m benchmarks.X`` / ``benchmarks/X.py`` the GPU lane's shell drivers and the docs give exists (a module
moved or renamed without its callers fails here, not on a lent GPU). ~3 s."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from benchmarks.__main__ import _name, available

ROOT = Path(__file__).resolve().parents[1]
SHELL = [ROOT / "benchmarks" / "run_all_gpu.sh", ROOT / "benchmarks" / "gpu_loan.sh",
         ROOT / "benchmarks" / "gpu_wheels.sh", ROOT / "benchmarks" / "peers" / "gpu_peer_sources.sh"]
# docs/status.md is the lead's record (old entries may name former paths); results READMEs are dated records
DOCS = [p for p in (ROOT / "docs").glob("*.md") if p.name != "status.md"] + [
    ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "peers" / "README.md"]


def named_modules(text: str) -> set[str]:
    """``benchmarks.a.b`` of every ``-m benchmarks.a.b`` / ``import benchmarks.a.b`` / ``benchmarks/a/b.py``."""
    dotted = re.findall(r"(?:-m |-p |from |import )(benchmarks(?:\.\w+)+)", text)
    paths = [p.removesuffix(".py").replace("/", ".") for p in re.findall(r"\bbenchmarks/[\w/]+\.py", text)]
    return set(dotted) | set(paths)


def test_every_command_names_an_existing_module():
    missing = {}
    for path in SHELL + DOCS:
        for module in named_modules(path.read_text()):
            parts = module.split(".")
            module_file = ROOT.joinpath(*parts).with_suffix(".py")
            package = ROOT.joinpath(*parts) / "__init__.py"
            owner = ROOT.joinpath(*parts[:-1]).with_suffix(".py")  # benchmarks.a.b.attribute
            if not (module_file.is_file() or package.is_file() or owner.is_file()):
                missing.setdefault(str(path.relative_to(ROOT)), []).append(module)
    assert not missing, missing


def test_the_runner_lists_and_names_the_lane_benchmarks():
    found = available()
    assert {"gpu.headline", "gpu.kernels", "sass.report", "peers.run_gpu_peers"} <= set(found)
    assert found["host.bench_predictors"][1] == "pytest-benchmark" and found["gpu.headline"][1] == "script"
    assert "common.checkpoint" not in found  # a helper with no command of its own
    assert _name("benchmarks/gpu/headline.py") == _name("gpu.headline") == "gpu.headline"


def test_the_runner_forwards_to_the_module_and_refuses_an_unknown_name():
    run = subprocess.run([sys.executable, "-m", "benchmarks", "disk/read.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu.no_such_benchmark"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no benchmark 'gpu.no_such_benchmark'" in run.stderr
