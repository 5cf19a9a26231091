"""Hybrid execution on a real (tiny, AWQ) model: the exact-token invariant with experts computed on the CPU.

Tolerance: experts computed on the CPU run torch's int4 kernel with bf16 activations, the others the fp32
reference, so logits differ from the all-resident reference by bf16 rounding: relative norm error below
INT4_RTOL (2e-2; measured ~5e-3 with every miss on the CPU). Greedy tokens are then equal whenever the
reference's top-1 / top-2 logit margin exceeds twice the largest logit deviation; the checkpoint below
(seed 20) has a margin of ~0.1 over the whole greedy path against deviations of ~0.03, and the fixture
checks that margin so a change of checkpoint cannot make the test pass or fail by luck.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint
from hybrid_helpers import AUTO_RATES, resident_reference, run_and_compare

from moeflow import MoEOffloadedMixtral
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = [pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels"),
              pytest.mark.usefixtures("calibration_cache")]

LAYERS, EXPERTS, TOP_K = 2, 4, 2
NEW_TOKENS = 12
MIN_MARGIN = 0.05  # reference top-1 minus top-2 logit along the greedy path (the fixture checks it)
CACHING_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hybrid")
    src = make_tiny_checkpoint(root / "fp32", seed=20, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=LAYERS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    awq = quantize_checkpoint(src, root / "awq", group_size=32, progress=False)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    expected, logits = resident_reference(awq, ids, NEW_TOKENS, MIN_MARGIN, MoEOffloadedMixtral.from_pretrained)
    return awq, ids, expected, logits


def _check(tiny, **config):
    awq, ids, expected, logits = tiny
    return run_and_compare(awq, ids, expected, logits, config, MoEOffloadedMixtral.from_pretrained)

@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("mode", ["never", "auto", "always"])
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_greedy_tokens_equal_resident(tiny, policy, mode, transport):
    rates = AUTO_RATES if mode == "auto" else {}
    model = _check(tiny, policy=policy, gpu_expert_slots=3, cpu_compute=mode, transport=transport,
                   random_delay_ms=0.3, seed=3, **rates)
    s = model.stats
    cpu = s.prefill.cpu_experts + s.decode.cpu_experts
    if mode == "never":
        assert model.experts.cpu is None and cpu == 0
    else:
        assert model.experts.cpu.mode == mode and model.experts.cpu.rates is not None
    if mode == "always":
        assert cpu > 0 and s.prefill.cpu_s + s.decode.cpu_s > 0
        assert s.decode.bytes_h2d == 0 or policy == "mixtral-offloading"  # only its prefetches still copy
    if mode == "auto":
        assert cpu + s.prefill.cpu_races + s.decode.cpu_races > 0 and s.prefill.bytes_h2d > 0


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("slots", [2, 5])
def test_fiddler(tiny, slots, transport):
    model = _check(tiny, policy="fiddler", gpu_expert_slots=slots, transport=transport, random_delay_ms=0.3)
    backend = model.experts
    assert backend.cpu.mode == "always"
    fixed = backend.cache.policy.fixed
    assert fixed is not None and len(fixed) == min(slots, LAYERS * EXPERTS)  # placement frozen at decode
    s = model.stats
    assert s.prefill.cpu_experts + s.decode.cpu_experts > 0
    # in decode a miss is either a placed (popular) expert, copied whole, or computed on the CPU
    assert s.decode.bytes_h2d == (s.decode.misses - s.decode.cpu_experts) * backend.fmt.nbytes


def test_fiddler_auto(tiny):
    model = _check(tiny, policy="fiddler", gpu_expert_slots=3, cpu_compute="auto", **AUTO_RATES)
    assert model.experts.cpu.mode == "auto"


def test_measured_rates_and_ram(tiny, tmp_path):
    """Without overrides the rates come from a start-up calibration, cached on disk and reused."""
    model = _check(tiny, policy="lru", gpu_expert_slots=3, cpu_compute="auto")
    cpu = model.experts.cpu
    assert cpu.rates_source.startswith("measured") and cpu.rates.h2d_bytes_per_s > 0
    assert cpu.rates.cpu_expert_s > 0 and cpu.rates.cpu_token_s >= 0
    host = model.experts.host
    # the CPU int4 form of every expert sits beside its AWQ bytes: about as large again
    assert 0.9 < host.cpu_nbytes / host.nbytes < 1.3
    plan = model.memory_plan()  # and the memory plan counts it
    assert plan.cpu_forms == host.cpu_nbytes and "CPU expert forms" in plan.summary()
    assert plan.host_used == plan.host_reserved + plan.staging + plan.host_experts * plan.expert_bytes + plan.cpu_forms
    again = _check(tiny, policy="lru", gpu_expert_slots=3, cpu_compute="auto")
    assert again.experts.cpu.rates_source.startswith("cache") and again.experts.cpu.rates == cpu.rates
