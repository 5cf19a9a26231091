"""The DeepSeek-V3- and GLM-4.5-Air-shaped simulator presets: their model shapes, slot budgets, and a run."""

from __future__ import annotations

import pytest
import torch

from moeflow.kernels.pool import ExpertFormat
from moeflow.sim import get_profile, simulate
from moeflow.sim.profile import PRESET_NAMES, ProfileError
from moeflow.trace.synthetic import synthesize_trace


@pytest.mark.parametrize("name,shape,fit", [("deepseek-v3-pcie4-24gb", (58, 256, 8, 7168, 2048), 657),
                                            ("glm45-air-pcie4-24gb", (45, 128, 8, 4096, 1408), 2090)])
def test_family_presets_describe_their_models(name, shape, fit):
    layers, experts, top_k, hidden, inter = shape
    prof = get_profile(name)
    assert name in PRESET_NAMES
    assert (prof.num_layers, prof.num_experts, prof.top_k) == (layers, experts, top_k)
    assert prof.expert_bytes == ExpertFormat(hidden, inter, "awq", torch.float16, 128).nbytes
    assert prof.max_slots() == fit < layers * experts  # host-memory-bound: most experts stay in host memory
    with pytest.raises(ProfileError, match="num_experts"):
        prof.check_trace(32, 8, 2)


def test_deepseek_preset_simulates_a_shaped_trace():
    prof = get_profile("deepseek-v3-pcie4-24gb")
    trace, _ = synthesize_trace(num_layers=58, num_experts=256, top_k=8, sequences=1, prompt_len=2, new_tokens=3)
    bound = simulate(trace, "resident", 58 * 256, prof)
    fitted = simulate(trace, "ondemand", prof.max_slots(), prof)
    assert fitted.tpot_s > bound.tpot_s
    # every decode expert misses under ondemand: at least its copy per needed expert
    assert fitted.tpot_s >= 58 * 8 * prof.copy_s() * 0.99
