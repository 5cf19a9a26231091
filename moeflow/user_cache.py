"""Where moeflow keeps what it rebuilds on this machine (the CPU kernels' build, cost-model calibrations, tokenizers
rebuilt from GGUF metadata): one folder, one environment variable.

``$MOEFLOW_CACHE_DIR`` when set; else ``$MOEFLOW_CACHE`` (the CPU kernels' old name, still honoured); else
``$XDG_CACHE_HOME/moeflow``; else ``~/.cache/moeflow``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The folder (not created here: each user makes its own subfolder when it writes)."""
    for var in ("MOEFLOW_CACHE_DIR", "MOEFLOW_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "moeflow" if xdg else Path.home() / ".cache" / "moeflow"
