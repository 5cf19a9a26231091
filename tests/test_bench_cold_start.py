"""benchmarks/disk/cold_start.py's in-process parts on the tiny checkpoint (the cold processes are left to the
benchmark itself: two fresh interpreters cost more than this test should). ~3 s."""

from __future__ import annotations

from benchmarks.common.checkpoint import TINY, checkpoint_bytes, write_synthetic_awq_checkpoint
from benchmarks.disk import cold_start as bench


def test_reads_and_conversions_on_the_tiny_checkpoint(tmp_path):
    ckpt = write_synthetic_awq_checkpoint(tmp_path / "tiny", dict(TINY), group_size=32)
    files = bench.shard_files(ckpt)
    assert files and sum(f.stat().st_size for f in files) == checkpoint_bytes(ckpt)
    gbps, per_cpu = bench.read_single(files)
    assert gbps > 0 and per_cpu > 0
    assert bench.read_threads(files, 2) > 0
    conv = bench.conversions(dict(TINY), 32)
    assert {"pool panels, packed words", "cpu q4 rows, packed words"} <= conv.keys()
    assert all(v > 0 for k, v in conv.items() if k != "native")
