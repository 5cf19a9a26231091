"""MXFP4 experts computed on the CPU and hybrid execution on a tiny gpt-oss: the native kernel on the host store's
bytes (moeflow.kernels.cpu.mxfp4_native, int8 activations; tests/test_cpu_mxfp4_native.py tests the kernel) and,
where moeflow's CPU kernels do not build, torch's int4 digit form (moeflow.kernels.cpu.mxfp4, ``int4`` below).

The int4 digit form holds every MXFP4 weight exactly (two int4 digits); activations go through the int4 kernel in bf16
and each matmul's output is rounded to bf16, so results are within bf16 rounding of the fp32 reference. Hybrid
runs therefore join the greedy-token invariant with a tolerance, as tests/test_hybrid.py does for AWQ: logits
within INT4_RTOL of the all-resident model, and the fixture checks the reference's top-1 / top-2 margin along the
greedy path (seed 0: ~0.09 against deviations of ~0.03) so equal tokens are not luck.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint
from hybrid_helpers import AUTO_RATES, INT4_RTOL, resident_reference, run_and_compare

from moeflow import MoEModel, OffloadConfig
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.kernels.cpu.mxfp4 import Mxfp4CpuExpert, Mxfp4Int4Matrix, mxfp4_cpu_expert_reference
from moeflow.kernels.cpu.mxfp4_native import Mxfp4NativeExpert
from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4
from moeflow.kernels.formats import biased_expert_format
from moeflow.offload.hybrid import resolve_cpu_compute
from moeflow.offload.policies import POLICY_TABLE

pytestmark = [pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels"),
              pytest.mark.usefixtures("calibration_cache")]

BF16_MATMUL_RTOL = 1e-2  # one bf16 rounding of activations and of the output (~2**-8 each)
MIN_MARGIN = 0.06
NEW_TOKENS = 6


def _mxfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    block_scale = torch.exp2(torch.randint(-6, 3, (n, k // 32, 1), generator=g).float())  # varied block exponents
    w = (torch.randn(n, k // 32, 32, generator=g) * block_scale).view(n, k)
    return quantize_mxfp4(w)


@pytest.mark.parametrize("n,k", [(64, 32), (96, 160), (128, 64), (192, 288)])
def test_int4_digits_hold_every_weight_exactly(n, k):
    blocks, scales = _mxfp4(n, k, seed=n + k)
    m = Mxfp4Int4Matrix.from_mxfp4(blocks, scales)
    w = dequantize_mxfp4(blocks, scales)
    # x = identity: each output is one weight times 1, no sum to round: the digits must give W bit for bit
    assert torch.equal(m.matmul(torch.eye(k, dtype=torch.bfloat16)).float(), w.T)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.float() @ w.T
    got = m.matmul(x).float()
    assert float((got - want).abs().max() / want.abs().max()) < BF16_MATMUL_RTOL
    assert m.nbytes == n * k + (2 * k // 32) * n * 4  # 1 B per weight + a bf16 scale/zero pair per 32 per half


def test_scale_beyond_bf16_is_refused():
    blocks, scales = _mxfp4(64, 64, seed=0)
    scales[3, 1] = 254
    with pytest.raises(ValueError, match="w13.*254"):
        Mxfp4Int4Matrix.from_mxfp4(blocks, scales, "w13")


@pytest.mark.parametrize("bias", [True, False])
def test_expert_matches_its_reference_and_the_fp32_expert(bias):
    fmt = biased_expert_format(kind="mxfp4", hidden_size=64, intermediate_size=96, dtype=torch.float32,
                             activation="clamped_swiglu", bias=bias)
    w13_b, w13_s = _mxfp4(192, 64, seed=3)
    w2_b, w2_s = _mxfp4(64, 96, seed=4)
    g = torch.Generator().manual_seed(5)
    t = {"w13_blocks": w13_b, "w13_scales": w13_s, "w2_blocks": w2_b, "w2_scales": w2_s}
    if bias:
        t |= {"w13_bias": torch.randn(192, generator=g), "w2_bias": torch.randn(64, generator=g)}
    expert = Mxfp4CpuExpert.from_tensors(t, fmt)  # the int4 digit form (fmt.cpu_expert's without a C compiler)
    rows = torch.randn(7, 64, generator=g) * 4
    weights = torch.rand(7, generator=g)
    got = expert.forward(rows, weights)
    assert got.dtype == torch.float32 and got.shape == (7, 64)
    model = mxfp4_cpu_expert_reference(t, fmt, rows, weights)
    assert float((got - model).abs().max() / model.abs().max()) < BF16_MATMUL_RTOL
    # against the fp32 expert (biased_expert_forward_reference's numbers): bf16 rounding of two matmuls
    from moeflow.kernels.experts.biased import gate_activation
    h = rows @ dequantize_mxfp4(w13_b, w13_s).T + (t["w13_bias"] if bias else 0)
    y = gate_activation(h, fmt) @ dequantize_mxfp4(w2_b, w2_s).T + (t["w2_bias"] if bias else 0)
    fp32 = y * weights[:, None]
    assert float((got - fp32).norm() / fp32.norm()) < INT4_RTOL


def test_mxfp4_experts_may_run_on_the_cpu():
    fmt = biased_expert_format(kind="mxfp4", hidden_size=64, intermediate_size=64, dtype=torch.float32,
                             activation="clamped_swiglu")
    spec = POLICY_TABLE["fiddler"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back warning
        assert resolve_cpu_compute(OffloadConfig(policy="fiddler"), spec, fmt) == "always"
        assert resolve_cpu_compute(OffloadConfig(policy="lru", cpu_compute="auto"), POLICY_TABLE["lru"], fmt) == "auto"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_hybrid")
    ref = make_gpt_oss_model(seed=0, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
    save_gpt_oss_checkpoint(ref, path, mxfp4=True)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    expected, logits = resident_reference(path, ids, NEW_TOKENS, MIN_MARGIN)
    return path, ids, expected, logits


@pytest.fixture(params=["native", "int4"])
def cpu_form(request, monkeypatch):
    """Which CPU form MXFP4Format.cpu_expert builds: the native kernel's region views, or (as without a compiler)
    torch's int4 digits."""
    from moeflow.kernels.cpu import native

    if request.param == "native" and not native.native_available():
        pytest.skip("moeflow's CPU kernels do not build here")
    if request.param == "int4":
        monkeypatch.setattr(native, "native_available", lambda: False)
    return request.param


@pytest.mark.parametrize("config", [
    dict(policy="fiddler", gpu_expert_slots=5),
    dict(policy="fiddler", gpu_expert_slots=3, transport="random-delay", random_delay_ms=0.2),
    dict(policy="lru", gpu_expert_slots=3, cpu_compute="always"),
    dict(policy="lru", gpu_expert_slots=4, cpu_compute="auto", transport="random-delay", **AUTO_RATES),
    dict(policy="static", gpu_expert_slots=6, cpu_compute="auto", **AUTO_RATES),
])
def test_cpu_computed_mxfp4_experts_keep_the_tokens(tiny, config, cpu_form):
    path, ids, expected, logits = tiny
    model = run_and_compare(path, ids, expected, logits, config)
    s = model.stats
    assert s.prefill.cpu_experts + s.decode.cpu_experts + s.prefill.cpu_races + s.decode.cpu_races > 0
    cpu = model.experts.cpu
    assert cpu.rates is not None and cpu.rates.cpu_expert_s > 0
    host = model.experts.host
    if cpu_form == "native":  # views of the host store's regions: no extra RAM
        assert isinstance(host.cpu_expert(0, 0), Mxfp4NativeExpert) and host.cpu_nbytes == 0
    else:  # every expert's digit form sits beside its MXFP4 bytes: ~2.4x them at real shapes, more at tiny ones
        assert isinstance(host.cpu_expert(0, 0), Mxfp4CpuExpert) and 1.5 < host.cpu_nbytes / host.nbytes < 4


def test_fiddler_with_the_disk_tier(tiny, cpu_form):
    """Half the experts in host memory, the rest read from disk: the CPU forms of disk experts are converted from
    the bytes read (DiskHostStore.cpu_expert), the tokens stay those of the resident model."""
    from test_disk_tier import host_budget_gb

    from moeflow.offload import DiskHostStore

    path, ids, expected, _ = tiny
    model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(
        policy="fiddler", gpu_expert_slots=3, host_memory_gb=host_budget_gb(path, 8, kernels="torch"), disk_readers=2))
    try:
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        assert isinstance(model.experts.host, DiskHostStore)
        assert torch.equal(out, expected)
        assert model.stats.prefill.cpu_experts + model.stats.decode.cpu_experts > 0
    finally:
        model.close()


def test_cpu_rates_are_measured_for_the_mxfp4_form_and_cached_apart(tiny, tmp_path):
    """The cost model's CPU rates come from timing the MXFP4 CPU form; the cache key names the expert kind."""
    import json

    path, ids, _, _ = tiny
    model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(policy="fiddler", gpu_expert_slots=5))
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=[])
        cpu = model.experts.cpu
        assert cpu.rates_source.startswith("measured") and cpu.rates.cpu_expert_s > 0
        assert isinstance(model.experts.host.cpu_expert(0, 0), (Mxfp4NativeExpert, Mxfp4CpuExpert))
        cached = json.loads(open(cpu.rates_source.split(" ", 1)[1]).read())
        assert cached["key"]["model"]["kind"] == "mxfp4"
    finally:
        model.close()
