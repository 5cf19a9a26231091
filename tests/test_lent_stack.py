"""benchmarks/gpu/lent_stack/: the lent GPU machine's package set mirrored on a CPU machine (a sitecustomize.py on
PYTHONPATH that makes blocked.txt's modules unimportable from the venv's site-packages, allowed from
$LENT_STACK_ALLOW and from any other sys.path entry). ~1 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks" / "gpu" / "lent_stack"


def attempt(module: str, allow: str = "", extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE), extra_path) if p), LENT_STACK_ALLOW=allow)
    code = f"import {module}; print({module}.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_blocked_modules_are_unimportable_from_site_packages_and_found_where_allowed(tmp_path):
    blocked = HERE.joinpath("blocked.txt").read_text()
    assert "fastapi" in blocked and "gguf" in blocked and "torch" not in blocked.split()
    # a blocked name the environment may or may not hold: never from site-packages
    done = attempt("uvicorn")
    assert done.returncode != 0 and "blocked: not on the lent GPU machine" in done.stderr, done
    assert attempt("json").returncode == 0  # what is not listed imports as ever
    # .whl/ installed with --target (gpu_loan.sh's /tmp/site): allowed
    (tmp_path / "site" / "uvicorn").mkdir(parents=True)
    (tmp_path / "site" / "uvicorn" / "__init__.py").write_text("")
    done = attempt("uvicorn", allow=str(tmp_path / "site"))
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / "site" / "uvicorn" / "__init__.py"), done
    # a script's own sys.path entry (llama.cpp's converter inserting its gguf-py): allowed too
    done = attempt("uvicorn", extra_path=str(tmp_path / "site"))
    assert done.returncode == 0, done
