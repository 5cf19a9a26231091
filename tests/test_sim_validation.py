"""benchmarks/gpu/sim_validation.py: its CPU --tiny mode runs end to end (the GPU mode needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_validation_script_tiny(tmp_path):
    from benchmarks.gpu import sim_validation as mod

    result = mod.main(["--tiny", "--out", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"),
                       "--policies", "ondemand,lru,mixtral-offloading", "--budgets", "4"])
    saved = json.loads((tmp_path / "out" / "sim_validation.json").read_text())
    assert saved["profile"]["measured"] and saved["profile"]["h2d_gbps"] > 0
    runs = result["runs"]
    assert [r["policy"] for r in runs] == ["ondemand", "lru", "mixtral-offloading"]
    for r in runs:
        assert "error" not in r, r
        assert r["sim_tpot_s"] > 0 and r["measured_tpot_s"] > 0 and r["tokens_equal_reference"] is True
    assert "sim / measured" in (tmp_path / "out" / "sim_validation.md").read_text()
