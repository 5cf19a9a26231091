"""The GPU policy benchmark and the policy table script run end to end on the CPU."""

from __future__ import annotations

import json

import torch


def test_run_gpu_policies_tiny(tmp_path):
    from benchmarks.gpu import policies as run_gpu_policies

    threads = torch.get_num_threads()
    try:
        result = run_gpu_policies.main([
            "--tiny", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
            "--policies", "lru,duoserve,promoe,finemoe,auto", "--new-tokens", "3", "--prompt-len", "8",
            "--trace-prompts", "4", "--train-seconds", "2",
        ])
    finally:
        torch.set_num_threads(threads)
    runs = result["runs"]
    assert [r["policy"] for r in runs] == ["resident", "lru", "duoserve", "promoe", "finemoe", "auto"]
    assert all("error" not in r for r in runs), runs
    # the first run is the reference (None); every other one must have been compared, and be equal
    assert [r["tokens_equal_reference"] for r in runs] == [None] + [True] * (len(runs) - 1), runs
    assert (tmp_path / "ckpt" / "predictors" / "promoe.pt").is_file()
    assert set(result["overhead"]) == {"duoserve", "promoe"}
    saved = json.loads((tmp_path / "out" / "policies_results.json").read_text())
    assert saved["slots"] == 8 and "| duoserve | duoserve |" in (tmp_path / "out" / "policies_results.md").read_text()


def test_policy_table_script_small(tmp_path):
    from scripts import policy_table

    code = policy_table.main(["--budgets", "4", "--policies", "lru,promoe", "--stride", "48",
                              "--max-new-tokens", "3", "--workers", "1", "--out-dir", str(tmp_path), "--no-doc"])
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["lru", "promoe"] and all(r["tokens_equal"] for r in rows)
    assert all(r["bytes_per_token"] > 0 for r in rows)
