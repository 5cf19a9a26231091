"""Hybrid execution, piece by piece: cost-model decisions on constructed rates, calibration cache, bad input,
the AWQ -> int4pack repack, the host store's CPU forms, stats, and the GPU benchmark script's --tiny mode."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.kernels.cpu.int4 import INNER_K_TILES, awq_to_int4pack_cpu, int4_cpu_available
from moeflow.kernels.formats import expert_format
from moeflow.offload import HostStore, Stats, calibration, get_policy
from moeflow.offload.calibration import cache_path, calibration_key, measure_cpu, resolve_rates
from moeflow.offload.cost_model import Candidate, Choice, Rates, plan
from moeflow.offload.hybrid import resolve_cpu_compute
from moeflow.quant.awq import unpack_int4

needs_int4 = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
MB = 1_000_000
# 1 MB copies in 1 ms; one token on the CPU 0.9 ms, each further token 0.5 ms
RATES = Rates(h2d_bytes_per_s=1e9, cpu_expert_s=0.9e-3, cpu_token_s=0.5e-3)


def miss(e, tokens, keep=False):
    return Candidate(e, tokens, MB, keep_on_device=keep)


# ------------------------------------------------------------------------------------------ cost model
def test_never_copies_everything():
    assert set(plan([miss(0, 1), miss(1, 9)], RATES, mode="never").values()) == {Choice.COPY}


def test_always_computes_misses_on_the_cpu_except_placed_and_loading():
    cands = [miss(0, 7), miss(1, 1, keep=True), Candidate(2, 1, 0, loading=True)]
    assert plan(cands, RATES, mode="always") == {0: Choice.CPU, 1: Choice.COPY, 2: Choice.COPY}


def test_auto_one_token_races_many_tokens_copy():
    # one token: CPU 0.9 ms vs copy 1.0 ms, within the 25% margin -> both; 4 tokens: 2.4 ms vs 1 ms -> copy
    assert plan([miss(0, 1)], RATES, mode="auto") == {0: Choice.BOTH}
    assert plan([miss(1, 4)], RATES, mode="auto") == {1: Choice.COPY}
    # together: the 4-token expert is planned first and takes the copy engine, so the other's copy would
    # land at 2 ms: the CPU (0.9 ms) alone
    assert plan([miss(0, 1), miss(1, 4)], RATES, mode="auto") == {0: Choice.CPU, 1: Choice.COPY}
    # without a margin the cheaper one alone
    assert plan([miss(0, 1)], RATES, mode="auto", race_margin=0.0) == {0: Choice.CPU}


def test_auto_backlog_moves_misses_to_the_cpu():
    # 3 MB already queued: a copy lands after 4 ms, the CPU needs 0.9 ms
    assert plan([miss(0, 1)], RATES, mode="auto", backlog_bytes=3 * MB) == {0: Choice.CPU}
    # several misses: copies queue behind each other, so later ones go to the CPU (most tokens planned first)
    got = plan([miss(0, 2), miss(1, 2), miss(2, 2)], RATES, mode="auto", race_margin=0.0)
    assert got == {0: Choice.COPY, 1: Choice.CPU, 2: Choice.COPY}  # copy ends 1, 2, 3 ms; CPU 1.4 then 2.8


def test_auto_busy_worker_and_more_workers():
    cands = [miss(0, 1), miss(1, 1), miss(2, 1)]
    one = plan(cands, RATES, mode="auto", race_margin=0.0, backlog_bytes=10 * MB)
    assert list(one.values()).count(Choice.CPU) == 3  # copies would land after 11+ ms; 3 x 0.9 ms on one worker
    slow_cpu = Rates(1e9, 4.5e-3, 0.0)
    got = plan(cands, slow_cpu, mode="auto", race_margin=0.0, backlog_bytes=4 * MB)
    # copies land at 5, 6 ms; the one worker finishes at 4.5, then 9 ms
    assert got == {0: Choice.CPU, 1: Choice.COPY, 2: Choice.COPY}
    two = plan(cands, slow_cpu, mode="auto", race_margin=0.0, backlog_bytes=4 * MB, cpu_workers=2)
    assert list(two.values()).count(Choice.CPU) == 2


def test_auto_counts_cpu_jobs_still_running_from_earlier_layers():
    # a lone one-token miss: CPU 0.9 ms beats a copy behind 1 MB of backlog (2 ms) on a free worker ...
    assert plan([miss(0, 1)], RATES, mode="auto", race_margin=0.0, backlog_bytes=MB) == {0: Choice.CPU}
    # ... but not behind a lost race's job with 1.5 ms left (2.4 ms); with two workers the other one is free
    busy = plan([miss(0, 1)], RATES, mode="auto", race_margin=0.0, backlog_bytes=MB, cpu_busy_s=[1.5e-3])
    assert busy == {0: Choice.COPY}
    two = plan([miss(0, 1)], RATES, mode="auto", race_margin=0.0, backlog_bytes=MB, cpu_busy_s=[1.5e-3],
               cpu_workers=2)
    assert two == {0: Choice.CPU}


def test_auto_loading_expert_is_raced_never_cancelled():
    # a prefetch with 5 MB to move before it lands: the CPU is faster, start both (the copy still caches)
    assert plan([Candidate(0, 1, 5 * MB, loading=True)], RATES, mode="auto") == {0: Choice.BOTH}
    assert plan([Candidate(0, 1, MB // 10, loading=True)], RATES, mode="auto") == {0: Choice.COPY}


def test_plan_rejects_unknown_mode():
    with pytest.raises(ValueError, match="cpu_compute"):
        plan([], RATES, mode="sometimes")


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("value", ["sometimes", "AUTO", "", 1, True])
def test_bad_cpu_compute_values(value):
    with pytest.raises(ValueError, match="cpu_compute"):
        OffloadConfig(policy="lru", cpu_compute=value)


@pytest.mark.parametrize("field,value", [("cpu_workers", 0), ("h2d_gbps", 0.0), ("cpu_expert_ms", -1.0),
                                         ("cpu_token_ms", -0.1), ("race_margin", -0.5)])
def test_bad_rate_overrides(field, value):
    with pytest.raises(ValueError, match=field):
        OffloadConfig(policy="lru", **{field: value})


AWQ_FMT = expert_format(128, 128, "awq", torch.float16, group_size=32)
DENSE_FMT = expert_format(128, 128, "dense", torch.float32)


def test_fiddler_cannot_run_without_cpu_compute():
    with pytest.raises(SchedulingError, match="cpu_compute='never'"):
        resolve_cpu_compute(OffloadConfig(policy="fiddler", cpu_compute="never"), get_policy("fiddler"), AWQ_FMT)
    with pytest.raises(SchedulingError, match="not AWQ"):
        resolve_cpu_compute(OffloadConfig(policy="fiddler"), get_policy("fiddler"), DENSE_FMT)


def test_policy_defaults_and_dense_fallback():
    assert resolve_cpu_compute(OffloadConfig(policy="lru"), get_policy("lru"), AWQ_FMT) == "never"
    assert resolve_cpu_compute(OffloadConfig(policy="fiddler"), get_policy("fiddler"), AWQ_FMT) == "always"
    assert resolve_cpu_compute(OffloadConfig(policy="resident", cpu_compute="auto"), get_policy("resident"),
                               AWQ_FMT) == "never"
    with pytest.warns(RuntimeWarning, match="not AWQ.*cpu_compute='never'"):
        assert resolve_cpu_compute(OffloadConfig(policy="lru", cpu_compute="auto"), get_policy("lru"),
                                   DENSE_FMT) == "never"


def test_no_int4_kernels_is_a_clear_fallback(monkeypatch):
    import moeflow.kernels.cpu.int4 as cpu_int4

    monkeypatch.setattr(cpu_int4, "int4_cpu_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="lacks the int4 CPU kernels"):
        assert resolve_cpu_compute(OffloadConfig(policy="lru", cpu_compute="always"), get_policy("lru"),
                                   AWQ_FMT) == "never"
    with pytest.raises(SchedulingError, match="lacks the int4 CPU kernels"):
        resolve_cpu_compute(OffloadConfig(policy="fiddler"), get_policy("fiddler"), AWQ_FMT)


def test_dense_model_with_cpu_compute_runs_on_the_device(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=0, num_hidden_layers=1, num_local_experts=4)
    with pytest.warns(RuntimeWarning, match="not AWQ"):
        model = MoEOffloadedMixtral.from_pretrained(src, offload=OffloadConfig(policy="lru", gpu_expert_slots=2,
                                                                               cpu_compute="auto"))
    assert model.experts.cpu is None


# ------------------------------------------------------------------------------------------ calibration
def _key(**changes):
    key = calibration_key(AWQ_FMT, torch.device("cpu"), transport="sync", pinned=False, workers=1)
    for name, value in changes.items():
        if name in key["model"]:
            key["model"][name] = value
        else:
            key[name] = value
    return key


class Measure:
    def __init__(self, rates):
        self.rates, self.calls = rates, 0

    def __call__(self):
        self.calls += 1
        return self.rates


def test_calibration_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path))
    key, measure = _key(), Measure(RATES)
    rates, source = resolve_rates(OffloadConfig(), key, measure)
    assert rates == RATES and source.startswith("measured") and measure.calls == 1
    path = cache_path(key)
    assert path.parent == tmp_path and json.loads(path.read_text())["key"] == key
    rates, source = resolve_rates(OffloadConfig(), key, measure)
    assert rates == RATES and source.startswith("cache") and measure.calls == 1
    # another model shape is another file (the key is part of the name)
    assert cache_path(_key(hidden=4096)) != path


@pytest.mark.parametrize("change", [{"machine": "another-host"}, {"hidden": 4096}, {"torch": "2.0.0"},
                                   {"device": "NVIDIA H100"}])
def test_calibration_file_from_elsewhere_is_refused_and_remeasured(tmp_path, change):
    path = tmp_path / "rates.json"
    other = Rates(1.0, 1.0, 1.0)
    resolve_rates(OffloadConfig(calibration_file=str(path)), _key(**change), Measure(other))
    assert json.loads(path.read_text())["rates"]["cpu_expert_s"] == 1.0
    measure = Measure(RATES)
    what = next(iter(change))
    with pytest.warns(RuntimeWarning, match=f"refusing calibration file .*another machine or model.*{what}"):
        rates, source = resolve_rates(OffloadConfig(calibration_file=str(path)), _key(), measure)
    assert rates == RATES and measure.calls == 1 and source.startswith("measured")
    assert json.loads(path.read_text())["key"] == _key()  # overwritten with this machine's numbers


def test_unreadable_calibration_file(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable calibration file"):
        rates, _ = resolve_rates(OffloadConfig(calibration_file=str(path)), _key(), Measure(RATES))
    assert rates == RATES


def test_config_overrides_replace_measurements(tmp_path):
    measure = Measure(RATES)
    cfg = OffloadConfig(h2d_gbps=25.0, cpu_expert_ms=10.0, cpu_token_ms=2.0, calibration_file=str(tmp_path / "r"))
    rates, source = resolve_rates(cfg, _key(), measure)
    assert source == "config" and measure.calls == 0 and not (tmp_path / "r").exists()
    assert rates == Rates(25e9, 10e-3, 2e-3)
    partial = OffloadConfig(h2d_gbps=25.0, calibration_file=str(tmp_path / "r"))
    rates, _ = resolve_rates(partial, _key(), measure)
    assert rates == Rates(25e9, RATES.cpu_expert_s, RATES.cpu_token_s) and measure.calls == 1


def test_cpu_cost_with_free_tokens():
    """A memory-bound kernel: the first tokens' compute hides under the weight read, the rest adds up."""
    r = Rates(1e9, 6.9e-3, 2.3e-3, cpu_free_tokens=3.0)
    assert [round(r.cpu_time(t) * 1e3, 2) for t in (1, 2, 3, 4, 16)] == [6.9, 6.9, 6.9, 9.2, 36.8]
    assert RATES.cpu_time(4) == pytest.approx(0.9e-3 + 3 * 0.5e-3)  # the default: every further token


class FakeCpuExpert:
    """A fake CPU expert whose forward advances a fake clock by ``cost(tokens)`` seconds."""

    def __init__(self, cost) -> None:
        self.cost, self.now = cost, 0.0

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> None:
        self.now += self.cost(x.shape[0])


@pytest.mark.parametrize("cost,want", [
    (lambda t: max(6.9e-3, t * 2.3e-3), (6.9e-3, 2.3e-3, 3.0)),  # memory-bound up to 3 tokens (moeflow's int4)
    (lambda t: 50e-3 + (t - 1) * 31e-3, (50e-3, 31e-3, 1.0)),  # compute from the second token (torch's int4)
    (lambda t: 1e-3, (1e-3, 0.0, 1.0)),  # no cost per token at all
])
def test_calibration_fits_the_cpu_cost_shape(monkeypatch, cost, want):
    expert = FakeCpuExpert(cost)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: expert.now)
    got = measure_cpu(expert, 16, lambda fn: fn())
    assert got == pytest.approx(want)
    rates = Rates(1e9, *got)
    assert all(rates.cpu_time(t) == pytest.approx(cost(t)) for t in (1, 2, 3, 4, 8, 16, 32))


def test_configured_token_rate_is_charged_from_the_second_token(tmp_path):
    measured = Rates(1e9, 6.9e-3, 2.3e-3, cpu_free_tokens=3.0)
    cfg = OffloadConfig(cpu_token_ms=4.0, calibration_file=str(tmp_path / "r"))
    rates, _ = resolve_rates(cfg, _key(), Measure(measured))
    assert rates == Rates(1e9, 6.9e-3, 4e-3, cpu_free_tokens=1.0)
    rates, _ = resolve_rates(OffloadConfig(calibration_file=str(tmp_path / "r")), _key(), Measure(measured))
    assert rates == measured  # from the file, with its free tokens


# ------------------------------------------------------------------------------------------ CPU forms
@needs_int4
@pytest.mark.parametrize("K,N", [(256, 128), (128, 512), (64, 96), (96, 64)])
def test_awq_repack_matches_torch_conversion(K, N):
    q = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), generator=torch.Generator().manual_seed(K + N),
                      dtype=torch.int64).to(torch.int32)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q).T.contiguous(), INNER_K_TILES)
    assert torch.equal(awq_to_int4pack_cpu(q), want)


@needs_int4
def test_host_store_cpu_form_is_cached_and_invalidated():
    from test_cpu_int4 import awq_expert

    store = HostStore(AWQ_FMT, 1, 2, pin=False, device="cpu")
    t = awq_expert(128, 128, 32, seed=0)
    t = {**t, "w13_scales": t["w13_scales"].half(), "w2_scales": t["w2_scales"].half()}
    for e in range(2):
        store.write(0, e, t)
    first = store.cpu_expert(0, 1)
    assert store.cpu_expert(0, 1) is first and store.cpu_nbytes == first.nbytes
    rows, w = torch.randn(3, 128), torch.rand(3)
    from moeflow.kernels.cpu.int4 import int4_expert_reference

    ref = int4_expert_reference(t, 32, rows, w)
    assert float((first.forward(rows, w) - ref).norm() / ref.norm()) < 2e-2
    store.write(0, 1, t)
    assert store.cpu_expert(0, 1) is not first


def test_stats_have_cpu_fields():
    s = Stats()
    s.decode.cpu_experts, s.decode.cpu_s = 3, 0.25
    d = s.as_dict()
    assert d["decode"]["cpu_experts"] == 3 and d["prefill"]["cpu_races"] == 0 and "hit_rate" in d["decode"]
    assert "3 experts on the CPU (250.0 ms)" in s.summary()
    assert "on the CPU" not in Stats().summary()


# ------------------------------------------------------------------------------------------ GPU script
@needs_int4
def test_run_gpu_hybrid_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    from benchmarks.gpu import hybrid as run_gpu_hybrid

    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            result = run_gpu_hybrid.main([
                "--tiny", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--budgets", "3",
                "--policies", "lru,fiddler", "--new-tokens", "3", "--prompt-len", "6",
            ])
    finally:
        torch.set_num_threads(threads)
    runs = result["runs"]
    assert [(r["policy"], r["mode"]) for r in runs] == [("lru", "never"), ("lru", "auto"), ("fiddler", "auto")]
    assert all("error" not in r for r in runs)
    assert result["rates"]["h2d_bytes_per_s"] > 0 and "lru @ 3" in result["auto_over_never"]
    fiddler = runs[-1]["stats"]
    assert fiddler["prefill"]["cpu_experts"] + fiddler["decode"]["cpu_experts"] > 0
    assert "| 3.0 | 3 | fiddler | auto |" in (tmp_path / "out" / "hybrid_results.md").read_text()
