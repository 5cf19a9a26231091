"""Test-wide set-up. TRITON_INTERPRET must be set before any module defining @triton.jit kernels is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# test tensors are tiny: torch's intra-op threads only spin-wait (5x slower seen on a loaded 2-core machine)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, restored after it (tests elsewhere may change the count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """The hybrid cost model's calibration cache in the test's own folder: never the user's cache."""
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
