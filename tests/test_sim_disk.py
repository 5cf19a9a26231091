"""The simulator's disk tier (issue 20): a host cache smaller than the model costs disk reads in virtual time."""

from __future__ import annotations

import dataclasses

import pytest

from moeflow.cli import main
from moeflow.sim.disk import SimDiskTier
from moeflow.sim.profile import ProfileError, custom_profile
from moeflow.sim.simulator import simulate
from moeflow.trace.synthetic import synthesize_trace

PROFILE = custom_profile(h2d_gbps=20.0, expert_mb=40.0, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                         head_ms=0.4, sched_ms=0.05, latency_us=12.0, disk_gbps=3.0, disk_latency_us=80.0)
TOTAL = 4 * 8


@pytest.fixture(scope="module")
def trace():
    t, _ = synthesize_trace(num_layers=4, num_experts=8, top_k=2, hidden_size=32, sequences=2, prompt_len=7,
                            new_tokens=7, seed=1)
    return t


def test_a_free_disk_changes_nothing(trace):
    base = simulate(trace, "lru", 8, PROFILE, timeline=False)
    free = simulate(trace, "lru", 8, PROFILE.with_overrides(disk_gbps=1e9, disk_latency_us=0.0), timeline=False,
                    host_experts=TOTAL // 4)
    assert free.disk_bytes > 0 and free.host_experts == TOTAL // 4
    assert free.tpot_s == pytest.approx(base.tpot_s, rel=1e-6)
    assert base.disk_bytes == 0 and base.host_experts == TOTAL


def test_disk_reads_cost_time_and_shrink_with_host_memory(trace):
    runs = {h: simulate(trace, "lru", 8, PROFILE, timeline=False, host_experts=h) for h in (8, 16, TOTAL)}
    assert runs[TOTAL].disk_bytes == 0
    assert runs[8].disk_bytes >= runs[16].disk_bytes > 0
    assert runs[8].tpot_s >= runs[16].tpot_s > runs[TOTAL].tpot_s
    assert runs[8].disk_bytes % PROFILE.expert_bytes == 0  # whole experts
    assert runs[8].disk_busy_s == pytest.approx(runs[8].disk_bytes / (PROFILE.disk_gbps * 1e9))


def test_prefetching_policy_hides_part_of_the_disk(trace):
    lru = simulate(trace, "lru", 8, PROFILE, timeline=False, host_experts=8)
    oracle = simulate(trace, "oracle", 8, PROFILE, timeline=False, host_experts=8)
    assert oracle.tpot_s < lru.tpot_s


def test_disk_read_model():
    disk = SimDiskTier(2, expert_bytes=3 * 10**9, disk_gbps=3.0, disk_latency_us=1000.0, warm=[(0, 0)])
    assert disk.ready_at((0, 0), 5.0) == (0.0, None)  # warm
    end, start = disk.ready_at((0, 1), 5.0)
    assert (start, end) == (5.0, pytest.approx(6.001))
    end2, start2 = disk.ready_at((0, 2), 5.0)  # queued behind the first read's transfer
    assert start2 == pytest.approx(6.0) and end2 == pytest.approx(7.001)
    assert (0, 0) not in disk.ready and disk.reads == 2  # two rows: the least recently used left


def test_profile_without_a_disk_is_refused(trace):
    with pytest.raises(ProfileError, match="disk_gbps"):
        simulate(trace, "lru", 8, dataclasses.replace(PROFILE, disk_gbps=None), host_experts=8)
    with pytest.raises(ProfileError, match="disk_gbps"):
        PROFILE.with_overrides(disk_gbps=-1.0)


def test_cli_simulates_host_budgets(trace, tmp_path, capsys):
    path = trace.save(tmp_path / "t.trace")
    gib_per_expert = PROFILE.expert_bytes / 2**30
    assert main(["simulate", "--trace", str(path), "--policy", "lru", "--slots", "8", "--h2d-gbps", "20",
                 "--expert-mb", "40", "--disk-gbps", "3", "--host-memory-gb",
                 f"{8 * gib_per_expert:.4f},{TOTAL * gib_per_expert:.4f}"]) == 0
    out = capsys.readouterr().out
    assert "host experts" in out and "| 8/32 |" in out and "| 32/32 |" in out


def test_cli_host_budget_needs_a_disk(trace, tmp_path, capsys):
    path = trace.save(tmp_path / "t.trace")
    assert main(["simulate", "--trace", str(path), "--policy", "all", "--slots", "8", "--h2d-gbps", "20",
                 "--expert-mb", "40", "--host-memory-gb", "1"]) == 2
    assert "has no disk; give --disk-gbps" in capsys.readouterr().err
