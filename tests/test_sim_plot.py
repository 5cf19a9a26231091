"""Simulator figures (matplotlib: the `plot` extra, needed by the tests too)."""

from __future__ import annotations

import argparse

import matplotlib  # noqa: F401  (a test dependency: the figures are part of what is tested)

from moeflow.sim import custom_profile, simulate
from moeflow.sim.cli import register
from moeflow.sim.plot import plot_sweep, plot_timeline
from moeflow.trace.synthetic import synthesize_trace

PNG = b"\x89PNG\r\n\x1a\n"


def test_timeline_and_sweep_figures(tmp_path):
    trace, _ = synthesize_trace(num_layers=3, num_experts=8, top_k=2, hidden_size=16, sequences=1, prompt_len=5,
                                new_tokens=4)
    prof = custom_profile(h2d_gbps=20, expert_mb=40, layer_ms=0.3, expert_ms=0.2)
    r = simulate(trace, "lru", 6, prof)
    assert plot_timeline(r, tmp_path / "t.png").read_bytes()[:8] == PNG
    rows = [simulate(trace, p, n, prof, timeline=False).as_dict() for p in ("lru", "ondemand") for n in (4, 8)]
    out = plot_sweep(rows, tmp_path / "s.png", "sweep", bound_s=r.decode_bound_s, max_slots=12)
    assert out.read_bytes()[:8] == PNG


def test_simulate_command_plot(tmp_path):
    trace, _ = synthesize_trace(num_layers=3, num_experts=8, top_k=2, hidden_size=16, sequences=1, prompt_len=5,
                                new_tokens=4)
    trace.save(tmp_path / "t.safetensors")
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru,ondemand",
                          "--slots", "6", "--h2d-gbps", "20", "--expert-mb", "40", "--plot", str(tmp_path / "tl.png")])
    assert args.func(args) == 0
    assert (tmp_path / "tl-lru-6.png").read_bytes()[:8] == PNG
    assert (tmp_path / "tl-ondemand-6.png").is_file()


def test_timeline_with_a_cpu_lane(tmp_path):
    trace, _ = synthesize_trace(num_layers=3, num_experts=8, top_k=2, hidden_size=16, sequences=1, prompt_len=5,
                                new_tokens=4)
    prof = custom_profile(h2d_gbps=20, expert_mb=40, layer_ms=0.3, expert_ms=0.2, cpu_gbps=200.0)
    r = simulate(trace, "fiddler", 6, prof)
    assert any(iv.lane == "cpu" for iv in r.timeline_decode)
    assert plot_timeline(r, tmp_path / "cpu.png").read_bytes()[:8] == PNG
