"""What the CPU peer scripts record beside their numbers: the machine's load, and the JSON + Markdown pair."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path


def uptime() -> str:
    """``uptime``'s line (the load averages: this shared machine's numbers mean little without them)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_line() -> str:
    """The CPU's model, the cores this process sees and its vector flags (avx*, fma, f16c, amx*): what every CPU
    result names."""
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    keep = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    return f"{model.group(1) if model else '?'} ({os.cpu_count()} cores seen), flags: {' '.join(keep)}"


def write_report(out: Path, result: dict, lines: list[str]) -> None:
    """``result`` to ``out``.json and the Markdown ``lines`` to ``out``.md (the folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
