"""The DeepSeek-V3-, GLM-4.5-Air-, MiniMax-M2- and Qwen3-Next-shaped simulator presets: their model shapes, slot
budgets, and runs."""

from __future__ import annotations

import pytest
import torch

from moeflow.kernels.formats import expert_format
from moeflow.sim import get_profile, simulate
from moeflow.sim.profile import PRESET_NAMES, ProfileError
from moeflow.trace.synthetic import synthesize_trace


@pytest.mark.parametrize("name,shape,fit", [("deepseek-v3-pcie4-24gb", (58, 256, 8, 7168, 2048), 657),
                                            ("glm45-air-pcie4-24gb", (45, 128, 8, 4096, 1408), 2090),
                                            ("minimax-m2-pcie4-24gb", (62, 256, 8, 3072, 1536), 2701),
                                            ("qwen3-next-pcie4-16gb", (48, 512, 10, 2048, 512), 7095)])
def test_family_presets_describe_their_models(name, shape, fit):
    layers, experts, top_k, hidden, inter = shape
    prof = get_profile(name)
    assert name in PRESET_NAMES
    assert (prof.num_layers, prof.num_experts, prof.top_k) == (layers, experts, top_k)
    assert prof.expert_bytes == expert_format(hidden, inter, "awq", torch.float16, 128).nbytes
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


def test_qwen3_next_preset_simulates_a_shaped_trace():
    """512 experts, top-10: a third of them fit; ondemand pays a copy per needed expert, resident none."""
    prof = get_profile("qwen3-next-pcie4-16gb")
    trace, _ = synthesize_trace(num_layers=48, num_experts=512, top_k=10, sequences=1, prompt_len=2, new_tokens=3)
    bound = simulate(trace, "resident", 48 * 512, prof)
    fitted = simulate(trace, "ondemand", prof.max_slots(), prof)
    assert fitted.tpot_s >= 48 * 10 * prof.copy_s() * 0.99 and fitted.tpot_s > bound.tpot_s
