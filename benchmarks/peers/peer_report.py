"""What the CPU peer scripts record beside their numbers: the machine's load, and the JSON + Markdown pair."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def uptime() -> str:
    """``uptime``'s line (the load averages: this shared machine's numbers mean little without them)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def write_report(out: Path, result: dict, lines: list[str]) -> None:
    """``result`` to ``out``.json and the Markdown ``lines`` to ``out``.md (the folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
