"""The simulator prices CPU compute: cpu_compute="auto", fiddler and llama.cpp's --n-cpu-moe placement, each checked
against a closed form within 1 % (the real scheduler and the runtime's cost model run; only the clock is virtual)."""

from __future__ import annotations

import argparse
import json

import pytest

from moeflow.sim import ProfileError, SimulationError, custom_profile, get_profile, simulate
from moeflow.sim.cli import register
from moeflow.sim.llamacpp import analytic_llamacpp_step_s, n_cpu_moe
from moeflow.sim.passes import analytic_placed_step_s, sequence_passes
from moeflow.trace import DECODE, PREFILL
from moeflow.trace.synthetic import synthesize_trace

L, E, K = 4, 8, 2
# a slow link (40 MB experts over 20 GB/s: 2 ms a copy) and a fast CPU (0.12 ms an expert): every miss goes to the CPU
CPU_FAST = custom_profile(h2d_gbps=20.0, expert_mb=40.0, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                          head_ms=0.4, sched_ms=0.05, latency_us=12.0, cpu_gbps=400.0, cpu_call_us=20.0)
# a fast link (0.1 ms a copy) and a slow CPU (4 ms an expert): the cost model never picks the CPU
CPU_SLOW = CPU_FAST.with_overrides(h2d_gbps=400.0, cpu_gbps=10.0)


@pytest.fixture(scope="module")
def small():
    trace, _ = synthesize_trace(num_layers=L, num_experts=E, top_k=K, hidden_size=32, sequences=2, prompt_len=7,
                                new_tokens=7, seed=1)
    return trace


def _decode_steps(trace):
    return [s for seq in sequence_passes(trace, None) for s in seq if s.phase == DECODE]


def _mean_analytic(trace, fn):
    steps = _decode_steps(trace)
    return sum(fn(s.rows) for s in steps) / len(steps)


@pytest.mark.parametrize("early_hits", [True, False], ids=["early-hits", "serial"])
def test_cpu_compute_auto_with_a_fast_cpu_equals_the_placed_closed_form(small, early_hits):
    """lru + cpu_compute="auto", CPU far cheaper than a copy: the cost model sends every miss to the CPU, so the cache
    keeps its warm start (experts 0 and 1 of every layer at 8 slots) and each layer costs max(h, s + c)."""
    trace = small
    r = simulate(trace, "lru", 2 * L, CPU_FAST, cpu_compute="auto", early_hits=early_hits)
    warm = {(l, e) for l in range(L) for e in range(2)}
    want = _mean_analytic(trace, lambda rows: analytic_placed_step_s(trace, CPU_FAST, rows, warm, early_hits))
    assert r.tpot_s == pytest.approx(want, rel=0.01)
    assert r.bytes_h2d == 0 and r.decode_cpu_experts > 0 and r.policy == "lru+cpu-auto"
    # the check can fail: without the CPU the same run is copy-bound and far slower
    assert simulate(trace, "lru", 2 * L, CPU_FAST, early_hits=early_hits).tpot_s > 1.5 * r.tpot_s


def test_cpu_compute_auto_with_a_slow_cpu_is_copy_only_lru(small):
    """The other side of the same decision: copies cheaper than the CPU, so auto runs exactly lru's copies."""
    trace = small
    auto = simulate(small, "lru", 2 * L, CPU_SLOW, cpu_compute="auto")
    copy = simulate(trace, "lru", 2 * L, CPU_SLOW)
    assert auto.cpu_experts == 0 and auto.cpu_busy_s == 0
    assert auto.tpot_s == copy.tpot_s and auto.bytes_h2d == copy.bytes_h2d > 0


def test_cpu_compute_always_prices_every_miss_on_the_cpu(small):
    """cpu_compute="always" with a CPU slower than the link still computes every miss on the CPU (placed form)."""
    r = simulate(small, "lru", 2 * L, CPU_SLOW, cpu_compute="always")
    warm = {(l, e) for l in range(L) for e in range(2)}
    want = _mean_analytic(small, lambda rows: analytic_placed_step_s(small, CPU_SLOW, rows, warm))
    assert r.tpot_s == pytest.approx(want, rel=0.01) and r.bytes_h2d == 0


def _prefill_routes_experts_0_and_1(trace):
    """The first sequence's prompt routes every token to experts 0 and 1 (in every layer): fiddler's placement from
    the first prefill is then those 2 x L experts, which is also the warm start at 2 L slots."""
    out = trace.rows(slice(0, len(trace)))
    first = next(s for s in sequence_passes(out, None)[0] if s.phase == PREFILL)
    out.topk_ids = out.topk_ids.clone()
    out.topk_ids[first.rows, :, 0] = 0
    out.topk_ids[first.rows, :, 1] = 1
    return out


@pytest.mark.parametrize("profile", [CPU_FAST, CPU_SLOW], ids=["fast-cpu", "slow-cpu"])
def test_fiddler_equals_the_placed_closed_form(small, profile):
    trace = _prefill_routes_experts_0_and_1(small)
    r = simulate(trace, "fiddler", 2 * L, profile)
    placed = {(l, e) for l in range(L) for e in range(2)}
    want = _mean_analytic(trace, lambda rows: analytic_placed_step_s(trace, profile, rows, placed))
    assert r.tpot_s == pytest.approx(want, rel=0.01)
    assert r.bytes_h2d == 0 and r.decode_cpu_experts > 0


@pytest.mark.parametrize("slots", [0, 8, 16, 24, 32])
def test_llamacpp_n_cpu_moe_equals_its_closed_form(small, slots):
    trace = small
    n = n_cpu_moe(slots, L, E)
    assert n == L - slots // E
    r = simulate(trace, "llamacpp-n-cpu-moe", slots, CPU_FAST)
    want = _mean_analytic(trace, lambda rows: analytic_llamacpp_step_s(trace, CPU_FAST, rows, n))
    assert r.tpot_s == pytest.approx(want, rel=0.01)
    assert r.bytes_h2d == 0 and r.slots == (L - n) * E
    assert r.decode_hit_rate == pytest.approx(1 - n / L)  # the share of layers on the GPU (every layer needs k)
    if slots == L * E:
        assert r.tpot_s == pytest.approx(simulate(trace, "resident", 1, CPU_FAST).tpot_s, rel=1e-9)
    else:  # the CPU layers are serial with the GPU: slower than all-resident by exactly their difference
        assert r.cpu_busy_s > 0 and r.decode_cpu_experts > 0


def test_llamacpp_prefill_offloads_big_batches_to_the_gpu():
    """A 40-token prompt (>= 32: llama.cpp's op offload) copies the used experts of the CPU layers over the link."""
    trace, _ = synthesize_trace(num_layers=L, num_experts=E, top_k=K, hidden_size=16, sequences=1, prompt_len=40,
                                new_tokens=2, seed=0)
    r = simulate(trace, "llamacpp-n-cpu-moe", 16, CPU_FAST)
    assert r.prefill_bytes_h2d > 0 and r.decode_bytes_h2d == 0


def test_cpu_policies_need_a_cpu_cost(small):
    no_cpu = CPU_FAST.with_overrides()
    no_cpu = type(no_cpu)(**{**no_cpu.as_dict(), "cpu_gbps": None})
    for policy, mode in (("fiddler", None), ("lru", "auto"), ("llamacpp-n-cpu-moe", None)):
        with pytest.raises(ProfileError, match="no CPU compute cost .*cpu-gbps"):
            simulate(small, policy, 2 * L, no_cpu, cpu_compute=mode)
    with pytest.raises(SimulationError, match="cpu_compute='sometimes'"):
        simulate(small, "lru", 8, CPU_FAST, cpu_compute="sometimes")
    with pytest.raises(SimulationError, match="does not take cpu_compute"):
        simulate(small, "llamacpp-n-cpu-moe", 8, CPU_FAST, cpu_compute="auto")
    with pytest.raises(ProfileError, match="cpu_gbps=0"):
        CPU_FAST.with_overrides(cpu_gbps=0.0)


def test_mixtral_presets_have_a_stated_cpu_cost():
    for name in ("pcie4-24gb", "h100-pcie5"):
        p = get_profile(name)
        assert p.cpu_gbps and "CPU:" in p.description and "estimates" in p.description
        assert p.cpu_expert_s(1) < p.copy_s(3)  # at one token the CPU beats a copy of the expert on both


def _run(argv):
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


def test_simulate_command_takes_the_cpu_policies(small, tmp_path, capsys):
    small.save(tmp_path / "t.safetensors")
    base = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--slots", "8,16", "--h2d-gbps", "20",
            "--expert-mb", "40", "--layer-ms", "0.3", "--expert-ms", "0.25", "--cpu-gbps", "400", "--cpu-call-us", "20"]
    assert _run([*base, "--policy", "lru,fiddler,llamacpp-n-cpu-moe", "--cpu-compute", "auto", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert {r["policy"] for r in rows} == {"lru+cpu-auto", "fiddler", "llamacpp-n-cpu-moe"}
    assert all(r["cpu_experts"] > 0 for r in rows)
    assert _run([*base, "--policy", "lru", "--cpu-compute", "auto"]) == 0
    assert "| lru+cpu-auto | 8/32 |" in capsys.readouterr().out
    with pytest.raises(ProfileError, match="no CPU compute cost"):
        _run([*base[:-4], "--policy", "fiddler"])


def _overlap(a, b) -> bool:
    return any(x.start < y.end - 1e-12 and y.start < x.end - 1e-12 for x in a for y in b)


def test_gpu_and_cpu_in_parallel_where_the_runtime_does(small):
    """fiddler: the device computes a layer's placed experts while the CPU computes the rest (overlapping bars);
    llama.cpp: a CPU layer waits for the GPU and the GPU for it (never overlapping). One CPU worker: its bars never
    overlap each other."""
    trace = _prefill_routes_experts_0_and_1(small)
    for policy, parallel in (("fiddler", True), ("llamacpp-n-cpu-moe", False)):
        r = simulate(trace, policy, 2 * L, CPU_SLOW)
        cpu = [iv for iv in r.timeline_decode if iv.lane == "cpu"]
        gpu = [iv for iv in r.timeline_decode if iv.lane == "compute" and iv.kind == "expert"]
        assert cpu and gpu
        for i, a in enumerate(cpu):
            assert not _overlap([a], cpu[i + 1:])
        assert _overlap(cpu, gpu) == parallel, policy


@pytest.mark.parametrize("cpu_gbps", [18.0, 22.0])
def test_races_when_copy_and_cpu_cost_about_the_same(small, cpu_gbps):
    """A copy (2 ms) and a CPU call (~2 ms) within the race margin: the cost model starts both, the first to finish
    is used (the CPU wins some), and on this trace auto beats both copy-only and always-CPU."""
    prof = CPU_FAST.with_overrides(cpu_gbps=cpu_gbps)
    auto = simulate(small, "lru", 2 * L, prof, cpu_compute="auto")
    assert auto.cpu_races > 0 and 0 < auto.cpu_race_wins <= auto.cpu_races and auto.bytes_h2d > 0
    assert 0 < auto.cpu_race_cancels <= auto.cpu_race_wins  # a load the CPU beat stops holding the link
    copy = simulate(small, "lru", 2 * L, prof)
    always = simulate(small, "lru", 2 * L, prof, cpu_compute="always")
    assert auto.tpot_s < min(copy.tpot_s, always.tpot_s)


def test_a_cancelled_queued_cpu_job_frees_its_place_on_the_lane():
    """Future.cancel semantics: a race lost before its CPU job started drops the job (the ones behind it move up);
    one that started keeps the lane to its end."""
    import torch

    from moeflow.config import OffloadConfig
    from moeflow.offload.stats import PhaseStats
    from moeflow.sim import SIM_FORMAT
    from moeflow.sim.engine import SimClock, SimHostStore, SimTransport
    from moeflow.sim.hybrid import SimHybridCompute

    clock = SimClock()
    transport = SimTransport(clock, bandwidth_bps=1e9, latency_s=0.0, scale=1.0, region_bytes=SIM_FORMAT.nbytes,
                             num_experts=E)
    host = SimHostStore(SIM_FORMAT, L, E)
    cpu = SimHybridCompute("always", OffloadConfig(policy="lru"), host, lambda key: False, profile=CPU_FAST,
                           transport=transport, copy_chunks=3)
    cpu.prepare(torch.device("cpu"), "sim")
    st = PhaseStats()
    ids = torch.tensor([[1, 2], [3, 2]], dtype=torch.int32)  # expert 2: two tokens (first on the lane), then 1, 3
    assert cpu.start_layer(0, torch.zeros(2, 1), ids, torch.ones(2, 2), [1, 2, 3], [], [], st) == [2, 1, 3]
    d1 = CPU_FAST.cpu_expert_s(1)
    d2 = CPU_FAST.cpu_expert_s(2)
    assert cpu._ends == pytest.approx({2: d2, 1: d2 + d1, 3: d2 + 2 * d1})
    clock.now = 0.5 * d2  # expert 2's job is running, 1 and 3 are queued
    cpu._drop_job(1)  # queued: dropped, 3 moves up
    cpu._drop_job(2)  # running: keeps the lane to its end
    assert cpu._ends == pytest.approx({3: d2 + d1}) and cpu.lanes[0] == pytest.approx(d2 + d1)
    assert cpu.busy_s == pytest.approx(d2 + d1) and st.cpu_s == pytest.approx(d2 + d1)
    cpu.finish(torch.zeros(4, 1), st)
    assert clock.now == pytest.approx(d2 + d1) and st.cpu_experts == 1
    cpu.close()
