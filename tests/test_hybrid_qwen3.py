"""Hybrid execution (experts computed on the CPU: fiddler, cpu_compute auto/always) on a Qwen3-MoE-shaped AWQ
model (64 experts, top-8, a dense layer between the MoE layers): greedy tokens equal to resident.

Tolerance as tests/test_hybrid.py: CPU experts run torch's int4 kernel with bf16 activations, so logits may
differ from the resident reference by bf16 rounding (relative norm error below INT4_RTOL); the fixture checks
the reference's top-1 / top-2 margin along the greedy path so equal tokens are not luck.
"""

from __future__ import annotations

import pytest
import torch
from family_models import make_family_checkpoint
from hybrid_helpers import AUTO_RATES, resident_reference, run_and_compare

from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = [pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels"),
              pytest.mark.usefixtures("calibration_cache")]

MIN_MARGIN = 0.05
NEW_TOKENS = 6
SHAPE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, num_hidden_layers=3,
             mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, num_experts=64,
             num_experts_per_tok=8, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_hybrid")
    src = make_family_checkpoint(root / "fp32", "qwen3_moe", seed=21, **SHAPE)
    awq = quantize_checkpoint(src, root / "awq", group_size=32, progress=False)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    expected, logits = resident_reference(awq, ids, NEW_TOKENS, MIN_MARGIN)
    return awq, ids, expected, logits


@pytest.mark.parametrize("config", [
    dict(policy="fiddler", gpu_expert_slots=8),
    dict(policy="fiddler", gpu_expert_slots=40, transport="random-delay", random_delay_ms=0.2),
    dict(policy="lru", gpu_expert_slots=9, cpu_compute="always"),
    dict(policy="lru", gpu_expert_slots=16, cpu_compute="auto", transport="random-delay", **AUTO_RATES),
    dict(policy="finemoe", gpu_expert_slots=16, cpu_compute="auto", **AUTO_RATES),
])
def test_cpu_computed_experts_keep_the_tokens(tiny, config):
    awq, ids, expected, logits = tiny
    model = run_and_compare(awq, ids, expected, logits, config)
    s = model.stats
    assert s.prefill.cpu_experts + s.decode.cpu_experts + s.prefill.cpu_races + s.decode.cpu_races > 0
