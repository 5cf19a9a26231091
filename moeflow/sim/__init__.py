"""Trace-driven simulation: the real scheduler on virtual time (see ``docs/simulator.md``).

::

    from moeflow.sim import simulate, get_profile
    result = simulate(Trace.load("trace.safetensors"), "lru", slots=64, profile=get_profile("pcie4-24gb"))
    result.tpot_s, result.ttft_s, result.hit_rate, result.bytes_h2d
"""

from __future__ import annotations

from moeflow.sim.batched import batch_passes
from moeflow.sim.engine import Interval, SimClock, SimCopyEngine, SimHandle, SimTransport
from moeflow.sim.hybrid import SimHybridCompute
from moeflow.sim.llamacpp import LLAMACPP_POLICY, analytic_llamacpp_step_s, n_cpu_moe
from moeflow.sim.passes import analytic_ondemand_step_s, analytic_placed_step_s, step_compute_s
from moeflow.sim.profile import (
    PRESET_NAMES,
    HardwareProfile,
    ProfileError,
    custom_profile,
    get_profile,
    presets,
)
from moeflow.sim.simulator import (
    SIM_FORMAT,
    OraclePredictor,
    SimResult,
    SimulationError,
    check_policy,
    known_policies,
    load_gates,
    simulate,
)

__all__ = [
    "Interval", "SimClock", "SimCopyEngine", "SimHandle", "SimTransport", "PRESET_NAMES", "HardwareProfile",
    "ProfileError", "custom_profile", "get_profile", "presets", "SIM_FORMAT", "OraclePredictor", "SimResult",
    "SimulationError", "analytic_ondemand_step_s", "check_policy", "known_policies", "load_gates", "simulate",
    "step_compute_s", "SimHybridCompute", "LLAMACPP_POLICY", "analytic_llamacpp_step_s", "n_cpu_moe",
    "analytic_placed_step_s", "batch_passes",
]
