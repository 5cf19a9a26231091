"""benchmarks/engine/mtp.py end to end in a tiny run (a few training steps, one short prompt): every row's tokens equal
plain greedy's, drafts forced right are all kept, and the offloaded rows report bytes. ~40 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_mtp_tiny(tmp_path):
    from benchmarks.engine import mtp as bench_mtp

    threads = torch.get_num_threads()
    try:
        report = bench_mtp.main(["--steps", "3", "--sequences", "4", "--prompts", "1", "--new-tokens", "6",
                                 "--forced", "1.0", "--out", str(tmp_path / "mtp.json")])
    finally:
        torch.set_num_threads(threads)
    rows = report["rows"]
    assert (tmp_path / "mtp.json").is_file() and len(rows) == 3 * 3 + 2 * 2
    assert all(r["tokens_equal"] for r in rows)
    forced = [r for r in rows if r.get("forced_correct") == 1.0]
    assert len(forced) == 4 and all(r["acceptance"] == 1.0 for r in forced)
    assert all(r["plain_bytes_per_token"] > 0 for r in rows if r["setting"] != "resident" and "forced_correct" not in r)
