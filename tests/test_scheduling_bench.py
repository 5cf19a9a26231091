"""The GPU offload benchmark's code runs end to end in its --tiny CPU mode."""

from __future__ import annotations

import json

import torch


def test_run_gpu_offload_tiny(tmp_path):
    from benchmarks.gpu import offload as run_gpu_offload

    threads = torch.get_num_threads()
    try:
        result = run_gpu_offload.main([
            "--tiny", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--budgets", "2,16",
            "--policies", "lru,mixtral-offloading", "--new-tokens", "3", "--prompt-len", "6", "--trace-tokens", "2",
        ])
    finally:
        torch.set_num_threads(threads)
    runs = result["runs"]
    assert [r["policy"] for r in runs] == ["resident", "lru", "mixtral-offloading", "lru", "mixtral-offloading"]
    assert all("error" not in r for r in runs), runs
    # resident is the reference (None); every offloaded run must have been compared, and be equal
    assert [r["tokens_equal_reference"] for r in runs] == [None] + [True] * (len(runs) - 1), runs
    saved = json.loads((tmp_path / "out" / "offload_results.json").read_text())
    assert saved["h2d"]["best_GBps"] > 0 and (tmp_path / "out" / "offload_trace.json.gz").is_file()
    assert "| lru | 2 |" in (tmp_path / "out" / "offload_results.md").read_text()
