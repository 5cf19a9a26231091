"""Benchmarks are collected from ``bench_*.py`` (pytest-benchmark); none asserts on time.

    python -m pytest benchmarks/gpu/bench_kernels.py --benchmark-json=out.json
"""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself; add the rest of bench_*.py
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
