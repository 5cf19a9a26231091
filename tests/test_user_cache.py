"""One cache folder for everything moeflow rebuilds (moeflow.user_cache): the variable's precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeflow.user_cache import cache_dir


def test_the_cache_folder_follows_moeflow_cache_dir_then_the_old_name_then_xdg(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("MOEFLOW_CACHE_DIR", "MOEFLOW_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "moeflow"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "moeflow"
    monkeypatch.setenv("MOEFLOW_CACHE", str(tmp_path / "old"))
    assert cache_dir() == tmp_path / "old"
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "new"))
    assert cache_dir() == tmp_path / "new"
