"""The simulator: the real scheduler on virtual time, checked against closed-form times (each within 1 %)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from moeflow.offload.copy_engine import chunk_ranges
from moeflow.sim import (
    PRESET_NAMES,
    SIM_FORMAT,
    HardwareProfile,
    ProfileError,
    SimulationError,
    analytic_ondemand_step_s,
    custom_profile,
    get_profile,
    presets,
    simulate,
    step_compute_s,
)
from moeflow.sim.cli import register
from moeflow.sim.passes import sequence_passes, step_bound_s
from moeflow.trace import DECODE
from moeflow.trace.synthetic import gate_modules, save_gates, synthesize_trace


@pytest.fixture(scope="module")
def small():
    trace, gates = synthesize_trace(num_layers=4, num_experts=8, top_k=2, hidden_size=32, sequences=2, prompt_len=7,
                                    new_tokens=7, seed=1)
    return trace, gates


# copies slower than compute (PCIe-like) and faster than compute: both sides of the max() in the pipeline
SLOW_COPY = custom_profile(h2d_gbps=20.0, expert_mb=40.0, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                           head_ms=0.4, sched_ms=0.05, latency_us=12.0)
FAST_COPY = custom_profile(h2d_gbps=400.0, expert_mb=40.0, layer_ms=0.5, expert_ms=0.3, expert_ms_per_token=0.02,
                           head_ms=0.4, sched_ms=0.05, latency_us=5.0)


def _decode_steps(trace):
    return [s for seq in sequence_passes(trace, None) for s in seq if s.phase == DECODE]


@pytest.mark.parametrize("profile", [SLOW_COPY, FAST_COPY], ids=["copy-bound", "compute-bound"])
def test_ondemand_equals_the_analytic_sum(small, profile):
    trace, _ = small
    steps = _decode_steps(trace)
    want = sum(analytic_ondemand_step_s(trace, profile, s.rows) for s in steps) / len(steps)
    r = simulate(trace, "ondemand", 4, profile)
    assert r.decode_steps == len(steps)
    assert r.tpot_s == pytest.approx(want, rel=0.01)
    # nothing is kept or predicted: every needed expert of every pass moved once, whole
    needed = sum(int(trace.topk_mask()[s.rows].any(0).sum()) for seq in sequence_passes(trace, None) for s in seq)
    assert r.hit_rate == 0.0 and r.prefetches == 0
    assert r.bytes_h2d == pytest.approx(needed * profile.expert_bytes, rel=1e-6)


def test_ondemand_analytic_sum_is_not_trivially_met(small):
    """The check can fail: the analytic sum moves with the copy cost, and so must the simulation."""
    trace, _ = small
    slow = simulate(trace, "ondemand", 4, SLOW_COPY).tpot_s
    slower = simulate(trace, "ondemand", 4, SLOW_COPY.with_overrides(h2d_gbps=10.0)).tpot_s
    assert slower > 1.5 * slow


@pytest.mark.parametrize("profile", [SLOW_COPY, FAST_COPY], ids=["copy-bound", "compute-bound"])
def test_resident_equals_compute_alone(small, profile):
    trace, _ = small
    steps = _decode_steps(trace)
    r = simulate(trace, "resident", 1, profile)
    alone = sum(step_compute_s(trace, profile, s.rows) for s in steps) / len(steps)
    # closed form for top-2 decode: per layer attention + 2 experts of one token, plus the head
    closed = profile.head_s + trace.num_layers * (profile.attn_s(1) + 2 * profile.expert_s(1))
    assert r.tpot_s == pytest.approx(alone, rel=0.01)
    assert r.tpot_s == pytest.approx(closed, rel=0.01)
    assert r.bytes_h2d == 0 and r.hit_rate == 1.0


@pytest.mark.parametrize("early_hits", [False, True], ids=["serial", "early-hits"])
def test_oracle_with_enough_slots_reaches_the_compute_bound(small, early_hits):
    trace, _ = small
    # copies of a layer's 2 experts (~0.2 ms) hide behind one layer of compute (~1.1 ms)
    r = simulate(trace, "oracle", 16, FAST_COPY, early_hits=early_hits)
    assert r.decode_hit_rate == 1.0
    assert r.tpot_s == pytest.approx(r.decode_bound_s, rel=0.01)
    steps = _decode_steps(trace)
    if early_hits:  # the experts in slots run while the host schedules: per layer max(experts, scheduling)
        bound = sum(step_bound_s(trace, FAST_COPY, s.rows, FAST_COPY.sched_s, True) for s in steps) / len(steps)
        assert bound < r.decode_compute_s + trace.num_layers * FAST_COPY.sched_s
    else:
        bound = r.decode_compute_s + trace.num_layers * FAST_COPY.sched_s
    assert r.decode_bound_s == pytest.approx(bound, rel=1e-9)
    # ... and it is a bound: no policy beats it, and on-demand is far from it
    for policy in ("lru", "ondemand", "static"):
        got = simulate(trace, policy, 16, FAST_COPY, timeline=False, early_hits=early_hits).tpot_s
        assert got >= r.decode_bound_s * 0.999
    assert simulate(trace, "ondemand", 16, FAST_COPY, early_hits=early_hits).tpot_s > 1.05 * r.decode_bound_s


def test_early_hits_hide_the_scheduling_behind_the_hits(small):
    """Every expert in a slot (lru at the whole model): with early hits a decode step costs per layer
    max(experts, scheduling) instead of their sum; the hit rate and bytes are the serial schedule's."""
    trace, _ = small
    total = trace.num_layers * trace.num_experts
    slow_host = FAST_COPY.with_overrides(sched_ms=0.5)
    serial = simulate(trace, "lru", total, slow_host, early_hits=False, timeline=False)
    early = simulate(trace, "lru", total, slow_host, early_hits=True, timeline=False)
    assert early.decode_hit_rate == serial.decode_hit_rate == 1.0 and early.bytes_h2d == serial.bytes_h2d
    assert early.tpot_s == pytest.approx(early.decode_bound_s, rel=0.01)
    assert serial.tpot_s == pytest.approx(serial.decode_bound_s, rel=0.01)
    assert early.tpot_s < serial.tpot_s - 0.5 * trace.num_layers * min(0.5e-3, 2 * slow_host.expert_s(1))


def test_oracle_is_copy_bound_on_slow_links(small):
    trace, _ = small
    r = simulate(trace, "oracle", 8, SLOW_COPY)
    # every needed expert is there in time (hit rate 1), but a copy (~2.1 ms) cannot hide behind a layer (~0.8 ms)
    assert r.decode_hit_rate == 1.0
    assert r.tpot_s > 1.5 * r.decode_bound_s
    assert r.decode_stall_s > 0


def test_policies_order_and_counters(small):
    trace, gates = small
    res = {p: simulate(trace, p, 12, SLOW_COPY, gates=gate_modules(gates)) for p in
           ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "oracle", "resident")}
    assert res["resident"].tpot_s < res["oracle"].tpot_s <= res["lru"].tpot_s < res["ondemand"].tpot_s
    assert res["mixtral-offloading"].prefetches > 0
    assert res["oracle"].wasted_prefetches == 0 or res["oracle"].useful_prefetches > 0
    for r in res.values():
        assert r.bytes_h2d == r.prefill_bytes_h2d + r.decode_bytes_h2d
        chunks = r.bytes_h2d * 3 / SLOW_COPY.expert_bytes
        assert chunks == pytest.approx(round(chunks), abs=1e-6)  # whole chunks of a third of an expert
        assert r.timeline_prefill and r.timeline_decode
        assert {iv.lane for iv in r.timeline_decode} <= {"compute", "copy"}
    # deterministic
    again = simulate(trace, "lru", 12, SLOW_COPY)
    assert again.tpot_s == res["lru"].tpot_s and again.bytes_h2d == res["lru"].bytes_h2d


def test_timeline_lanes_are_consistent(small):
    trace, _ = small
    r = simulate(trace, "lru", 6, SLOW_COPY)
    for lane in ("compute", "copy"):
        bars = sorted((iv.start, iv.end) for iv in r.timeline_decode if iv.lane == lane)
        for (_, a1), (b0, _) in zip(bars, bars[1:], strict=False):
            assert a1 <= b0 + 1e-12, f"{lane} stream runs two things at once"
    copies = [iv for iv in r.timeline_decode if iv.lane == "copy"]
    chunk = SLOW_COPY.expert_bytes / len(chunk_ranges(SIM_FORMAT.nbytes, 3)) / SLOW_COPY.bandwidth_bps
    assert all(iv.end - iv.start == pytest.approx(chunk + SLOW_COPY.h2d_latency_us * 1e-6) for iv in copies)


# ------------------------------------------------------------------------------------------ bad input
def test_profile_disagreeing_with_the_trace_is_refused(small):
    trace, _ = small
    with pytest.raises(ProfileError, match=r"num_layers: trace .* has 4, the profile 32") as e:
        simulate(trace, "lru", 8, get_profile("pcie4-24gb"))
    assert "num_experts" not in str(e.value)  # 8 experts and top-2 agree: only the layers are named
    other = HardwareProfile("x", 10.0, 1000, num_layers=4, num_experts=16, top_k=1)
    with pytest.raises(ProfileError, match="num_experts: .* has 8, the profile 16; top_k: .* has 2, the profile 1"):
        simulate(trace, "lru", 8, other)


@pytest.mark.parametrize("gbps", [0.0, -5.0, float("nan")])
def test_bad_bandwidth_is_refused(gbps):
    with pytest.raises(ProfileError, match="h2d_gbps"):
        custom_profile(h2d_gbps=gbps, expert_mb=10)
    with pytest.raises(ProfileError, match="h2d_gbps"):
        get_profile("pcie4-24gb").with_overrides(h2d_gbps=gbps)


def test_an_infinite_bandwidth_is_the_ideal_link():  # copies land when issued (the synchronous runtime's model)
    assert custom_profile(h2d_gbps=float("inf"), expert_mb=10).h2d_gbps == float("inf")
    assert get_profile("pcie4-24gb").with_overrides(h2d_gbps=float("inf")).h2d_gbps == float("inf")


def test_other_bad_profiles():
    with pytest.raises(ProfileError, match="expert_bytes"):
        HardwareProfile("x", 10.0, 0)
    with pytest.raises(ProfileError, match="attn_ms=-1"):
        custom_profile(h2d_gbps=10, expert_mb=1, layer_ms=-1)
    with pytest.raises(ProfileError, match="unknown profile fields"):
        HardwareProfile.from_dict({"name": "x", "h2d_gbps": 1, "expert_bytes": 1, "pcie": 4})
    with pytest.raises(ProfileError, match="unknown hardware profile 'pcie9'"):
        get_profile("pcie9")


def test_unknown_policy_is_refused(small):
    trace, _ = small
    with pytest.raises(SimulationError, match=r"unknown offload policy 'lru2'.*'lru'.*'oracle'"):
        simulate(trace, "lru2", 8, SLOW_COPY)


def test_speculation_needs_routers_and_hidden(small):
    trace, gates = small
    with pytest.raises(SimulationError, match="routers"):
        simulate(trace, "mixtral-offloading", 8, SLOW_COPY)
    bare = trace.rows(torch.arange(len(trace)))
    bare.hidden = None
    with pytest.raises(SimulationError, match="--hidden"):
        simulate(bare, "mixtral-offloading", 8, SLOW_COPY, gates=gate_modules(gates))


def test_too_few_slots_is_refused(small):
    trace, _ = small
    with pytest.raises(Exception, match="minimum is 2"):
        simulate(trace, "lru", 1, SLOW_COPY)


# ------------------------------------------------------------------------------------------ profiles
def test_presets_and_json_round_trip(tmp_path):
    p = presets()
    assert set(p) == set(PRESET_NAMES) and {"pcie4-24gb", "h100-pcie5"} <= set(p)
    pc = p["pcie4-24gb"]
    assert pc.expert_bytes == pytest.approx(87.3 * 2**20, rel=0.01)  # Mixtral-8x7B AWQ expert
    assert pc.copy_s(1) == pytest.approx(pc.expert_bytes / 25e9 + 10e-6)
    assert p["h100-pcie5"].h2d_gbps == 50.0 and pc.h2d_gbps == 25.0
    assert 150 < pc.max_slots() < 256
    path = pc.save(tmp_path / "p.json")
    assert get_profile(str(path)) == pc


def test_bench_profile_on_cpu_says_so(tmp_path):
    from moeflow.sim.bench import measure_profile

    prof = measure_profile("cpu", "tiny", repeats=2)
    assert prof.measured and "NO GPU" in prof.description
    assert prof.h2d_gbps > 0 and prof.expert_ms > 0 and prof.sched_ms > 0
    assert prof.num_layers == 4
    # the CPU expert cost (hybrid execution, fiddler, llama.cpp's placement) is measured too, and priced
    assert prof.cpu_gbps > 0 and prof.cpu_free_tokens >= 1 and "CPU experts" in prof.description
    assert prof.cpu_expert_s(1) >= prof.expert_bytes / (prof.cpu_gbps * 1e9)


# ------------------------------------------------------------------------------------------ command line
def _run(argv):
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


def test_simulate_command_json(small, tmp_path, capsys):
    trace, gates = small
    trace.save(tmp_path / "t.safetensors")
    save_gates(gates, tmp_path / "t.gates.safetensors")
    assert _run(["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "all", "--slots", "6,12",
                 "--h2d-gbps", "20", "--expert-mb", "40", "--layer-ms", "0.3", "--expert-ms", "0.25",
                 "--gates", str(tmp_path / "t.gates.safetensors"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["results"]
    policies = {r["policy"] for r in rows}
    assert {"resident", "ondemand", "lru", "mixtral-offloading", "oracle"} <= policies
    assert all(math.isfinite(r["tpot_s"]) and r["bytes_h2d"] >= 0 for r in rows)
    assert out["profile"]["h2d_gbps"] == 20


def test_simulate_command_table_and_errors(small, tmp_path, capsys):
    trace, _ = small
    trace.save(tmp_path / "t.safetensors")
    base = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--slots", "8"]
    assert _run([*base, "--policy", "lru,ondemand", "--profile", "pcie4-24gb", "--expert-mb", "87"]) == 0
    table = capsys.readouterr().out
    assert "| lru | 8/32 |" in table and "| ondemand | 8/32 |" in table
    with pytest.raises(ProfileError, match="num_layers"):
        _run([*base, "--policy", "lru", "--profile", "pcie4-24gb"])
    with pytest.raises(ProfileError, match="h2d_gbps=0"):
        _run([*base, "--policy", "lru", "--h2d-gbps", "0", "--expert-mb", "10"])
    with pytest.raises(SimulationError, match="unknown offload policy 'nope'"):
        _run([*base, "--policy", "nope", "--h2d-gbps", "10", "--expert-mb", "10"])
    with pytest.raises(ProfileError, match="--h2d-gbps and --expert-mb"):
        _run([*base, "--policy", "lru"])


def test_gpt_oss_profiles_simulate_a_gpt_oss_shaped_trace():
    """gpt-oss presets: MXFP4 expert size from the expert format, model shape checked, a 120b-shaped trace runs."""
    from moeflow.trace.synthetic import synthetic_trace

    p = presets()
    big, small = p["gpt-oss-120b-24gb"], p["gpt-oss-20b-12gb"]
    assert big.expert_bytes == pytest.approx(13.24e6, rel=0.01)  # 4.25 bits a weight + biases
    assert (big.num_layers, big.num_experts, big.top_k) == (36, 128, 4)
    assert (small.num_layers, small.num_experts, small.top_k) == (24, 32, 4)
    assert small.max_slots() < 24 * 32 < p["gpt-oss-120b-32gb"].max_slots()  # 20b needs offloading on 12 GB
    trace, _ = synthetic_trace(num_sequences=2, tokens_per_sequence=6, num_layers=36, num_experts=128, top_k=4,
                               hidden_size=16, seed=1)
    fast = simulate(trace, "lru", big.max_slots(), p["gpt-oss-120b-32gb"].with_overrides(gpu_memory_gb=24.0))
    slow = simulate(trace, "lru", big.max_slots(), big)
    assert 0 < slow.tokens_per_s < fast.tokens_per_s
    with pytest.raises(ProfileError, match="num_experts"):
        simulate(trace, "lru", 64, get_profile("pcie4-24gb"))
