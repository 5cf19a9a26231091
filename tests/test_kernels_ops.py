"""Custom ops (opcheck, torch.compile fullgraph), argument errors before launch, and the config table."""

from __future__ import annotations

import json

import pytest
import torch
from test_kernels import _pool, assert_close, make_routing

from moeflow import kernels
from moeflow.kernels.experts import configs
from moeflow.kernels.experts.ops import encode_linear_config, encode_moe_config
from moeflow.kernels.experts.reference import combine_reference, expert_forward_reference
from moeflow.quant.awq import quantize_rtn

H, I, E, G, K_TOP = 64, 96, 5, 32, 2  # noqa: E741
CFG = {"BLOCK_M": 4, "w13": {"BLOCK_N": 64, "BLOCK_K": 64}, "w2": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}}


@pytest.fixture(scope="module")
def setup():
    pool = _pool(H, I, E + 1, G, torch.float16)
    slot = torch.tensor([5, 1, 0, 3, 2], dtype=torch.int32)
    ids, w = make_routing(3, K_TOP, E, "uniform", 7)
    x = torch.randn(3, H, dtype=torch.float16)
    return pool, slot, ids, w, x


def _w(pool):
    t = pool.tensors
    return (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]), (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"])


# ---------------------------------------------------------------------------------------------------------
# opcheck on every op


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_routing_plan_and_combine(backend, setup):
    _, _, ids, _, _ = setup
    torch.library.opcheck(torch.ops.moeflow.routing_plan.default, (ids, E, 4, backend))
    y = torch.randn(6, H, dtype=torch.float16)
    torch.library.opcheck(torch.ops.moeflow.combine.default, (y, K_TOP, backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_expert_and_route_ops(backend, setup):
    pool, slot, ids, w, x = setup
    w13, w2 = _w(pool)
    flat = encode_moe_config(CFG)
    out = torch.zeros(ids.numel(), H, dtype=x.dtype)
    mask = torch.tensor([True, False, True, True, False])
    torch.library.opcheck(
        torch.ops.moeflow.expert_forward.default, (x, ids, w, *w13, *w2, slot, mask, G, flat, backend, out)
    )
    torch.library.opcheck(
        torch.ops.moeflow.expert_forward.default, (x, ids, w, *w13, *w2, slot, None, G, [], backend, out)
    )
    logits = torch.randn(3, E, dtype=torch.float16)
    torch.library.opcheck(torch.ops.moeflow.route.default, (logits, K_TOP, True, None, backend))
    gate = torch.randn(E, H, dtype=torch.float16) / 8
    torch.library.opcheck(torch.ops.moeflow.route.default, (x, K_TOP, False, gate, backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_awq_linear(backend):
    q = quantize_rtn(torch.randn(40, 128) / 10, 64)
    x = torch.randn(5, 128, dtype=torch.float16)
    flat = encode_linear_config({"BLOCK_M": 4, "BLOCK_N": 64, "BLOCK_K": 64})
    torch.library.opcheck(torch.ops.moeflow.awq_linear.default, (x, q.qweight, q.qzeros, q.scales, 64, flat, backend))
    torch.library.opcheck(torch.ops.moeflow.awq_linear.default, (x, q.qweight, q.qzeros, q.scales, 64, [], backend))
    p = kernels.pack_awq_linear(q.qweight, q.qzeros, q.scales)
    torch.library.opcheck(torch.ops.moeflow.awq_linear_packed.default,
                          (x, p["qweight"], p["qzeros"], p["scales"], 64, [], backend))


# ---------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of the MoE forward with the resident slot table (kept to one compile: ~5-30 s)


def test_compile_moe_forward_fullgraph(setup):
    pool, slot, ids, w, x = setup
    torch._dynamo.reset()
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    q = quantize_rtn(torch.randn(32, H) / 8, G)

    def f(x, ids, w):  # an AWQ projection feeding the MoE block, like attention output -> MoE
        x = x + kernels.awq_linear(x, q.qweight, q.qzeros, q.scales, G, "triton")[:, :1]
        return kernels.moe_forward(x, ids, w, pool, slot, "triton", config=CFG)

    compiled = torch.compile(f, fullgraph=True, backend=counting_backend)
    assert torch.equal(compiled(x, ids, w), f(x, ids, w))
    ids2, w2 = make_routing(3, K_TOP, E, "skewed", 8)
    assert torch.equal(compiled(x * 2, ids2, w2), f(x * 2, ids2, w2))
    assert len(calls) == 1  # same shapes, new values: no recompilation
    ops = {str(n.target) for n in calls[0].graph.nodes if n.op == "call_function"}
    for name in ("expert_forward", "combine", "awq_linear"):
        assert any(f"moeflow.{name}" in o for o in ops), (name, ops)
    eager = kernels.moe_forward(x, ids, w, pool, slot, "triton", config=CFG)
    ref = combine_reference(expert_forward_reference(x, ids, w, pool, slot, torch.empty(6, H, dtype=x.dtype)), 2)
    assert_close(eager, ref, torch.float16)


def test_compile_inductor_torch_backend(setup):
    pool, slot, ids, w, x = setup
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, ids, w: kernels.moe_forward(x, ids, w, pool, slot, "auto"), fullgraph=True)
    assert torch.equal(compiled(x, ids, w), kernels.moe_forward(x, ids, w, pool, slot, "torch"))


# ---------------------------------------------------------------------------------------------------------
# bad input: a clear error before launch


def _call(setup, **over):
    pool, slot, ids, w, x = setup
    args = {"x": x, "topk_ids": ids, "topk_weights": w, "pool": pool, "slot_of_expert": slot,
            "out": torch.empty(ids.numel(), H, dtype=x.dtype), "expert_mask": None, "backend": "triton"}
    args.update(over)
    return kernels.expert_forward(**args)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"x": torch.zeros(3, H, dtype=torch.int32)}, "x must be float16"),
        ({"x": torch.zeros(3, H + 8, dtype=torch.float16)}, "hidden size"),
        ({"topk_ids": torch.zeros(3, 2)}, "topk_ids must be int32"),
        ({"topk_ids": torch.tensor([[0, 1], [2, 5], [3, 4]], dtype=torch.int32)}, r"topk_ids: 1 expert ids outside"),
        ({"topk_ids": torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32)}, r"topk_ids: 1 expert ids outside"),
        ({"topk_weights": torch.ones(3, 3)}, "topk_weights"),
        ({"slot_of_expert": torch.tensor([0, 1, 2, 3, 6], dtype=torch.int32)}, "slot_of_expert points outside"),
        ({"slot_of_expert": torch.tensor([0, 1, -2, 3, 4], dtype=torch.int32)}, "slot_of_expert points outside"),
        ({"slot_of_expert": torch.arange(5)}, "slot_of_expert must be int32"),
        ({"out": torch.empty(6, H, dtype=torch.float32)}, "out must be"),
        ({"out": torch.empty(5, H, dtype=torch.float16)}, "out must be"),
        ({"out": torch.empty(H, 6, dtype=torch.float16).T}, "out must have a contiguous"),
        ({"expert_mask": torch.ones(5, dtype=torch.int32)}, "expert_mask must be bool"),
        ({"expert_mask": torch.ones(4, dtype=torch.bool)}, "expert_mask must be bool"),
        ({"backend": "cuda"}, "kernels backend 'cuda'"),
    ],
)
def test_expert_forward_bad_input(setup, over, match):
    with pytest.raises(ValueError, match=match):
        _call(setup, **over)


def test_validate_false_skips_value_checks_only(setup):
    pool, slot, ids, w, x = setup
    bad_slot = torch.tensor([0, 1, 2, 3, 99], dtype=torch.int32)
    unused = torch.tensor([[0, 1], [2, 1], [3, 0]], dtype=torch.int32)  # expert 4 (bad slot) unused: fine
    _call(setup, topk_ids=unused, slot_of_expert=bad_slot, backend="torch")
    with pytest.raises(ValueError, match="slot_of_expert points outside"):
        _call(setup, slot_of_expert=bad_slot, backend="torch", topk_ids=torch.tensor([[4, 1], [2, 1], [3, 0]],
                                                                                     dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be"):
        kernels.expert_forward(x.int(), ids, w, pool, slot, torch.empty(6, H), validate=False)


def test_awq_linear_bad_input():
    q = quantize_rtn(torch.randn(64, 128) / 10, 64)
    x = torch.randn(3, 128)
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        kernels.awq_linear(x, q.qweight.T.contiguous().T, q.qzeros, q.scales, 64, "triton")
    with pytest.raises(ValueError, match="qweight must have shape"):
        kernels.awq_linear(x[:, :64], q.qweight, q.qzeros, q.scales, 64, "triton")
    with pytest.raises(ValueError, match="qzeros must have shape"):
        kernels.awq_linear(x, q.qweight, q.qzeros[:1], q.scales, 64, "triton")
    with pytest.raises(ValueError, match="qweight must be int32"):
        kernels.awq_linear(x, q.qweight.to(torch.int64), q.qzeros, q.scales, 64, "triton")
    with pytest.raises(ValueError, match="scales must be float16"):
        kernels.awq_linear(x, q.qweight, q.qzeros, q.scales.int(), 64, "triton")
    with pytest.raises(ValueError, match="group_size=16"):
        kernels.awq_linear(x, q.qweight, q.qzeros, q.scales, 16, "triton")
    with pytest.raises(ValueError, match="x must be float16"):
        kernels.awq_linear(x.long(), q.qweight, q.qzeros, q.scales, 64, "triton")


# ---------------------------------------------------------------------------------------------------------
# config table


def _table(device: str, triton_version: str, block_m_by_m: dict[int, int], dtype: str = "float16") -> dict:
    return {
        "format": 1, "device": device, "triton": triton_version,
        "entries": [{
            "op": "moe", "kind": "awq", "dtype": dtype, "group_size": 128, "num_experts": 8, "top_k": 2,
            "n": 14336, "k": 4096,
            "configs": {str(m): {"BLOCK_M": bm, "w13": {"BLOCK_N": 128}, "w2": {"SPLIT_K": 1}}
                        for m, bm in block_m_by_m.items()},
        }],
    }


def _lookup(m, dtype=torch.float16, group=128):
    return configs.lookup_config("moe", m, kind="awq", dtype=dtype, group_size=group, num_experts=8, top_k=2,
                                 n=14336, k=4096, device="cpu")


def test_config_lookup_nearest_m_and_fallbacks(tmp_path, monkeypatch):
    monkeypatch.setenv(configs.ENV_CONFIG_DIR, str(tmp_path))
    (tmp_path / "a.json").write_text(json.dumps(_table("cpu", "0.1", {1: 2, 4096: 64})))
    configs.clear_cache()
    try:
        assert _lookup(1)["BLOCK_M"] == 2  # other Triton version: used when nothing better
        (tmp_path / "b.json").write_text(json.dumps(_table("cpu", configs.triton_version(), {1: 1, 16: 16, 512: 128})))
        configs.clear_cache()
        assert _lookup(1)["BLOCK_M"] == 1
        assert _lookup(3)["BLOCK_M"] == 16 and _lookup(5)["BLOCK_M"] == 16  # smallest tuned M >= T
        assert _lookup(100)["BLOCK_M"] == 128 and _lookup(10**6)["BLOCK_M"] == 128
        got = _lookup(512)
        assert got["w13"]["BLOCK_N"] == 128 and "BLOCK_K" in got["w13"] and "num_warps" in got["w2"]  # completed
        assert _lookup(1, dtype=torch.bfloat16) == configs.default_config("moe", 1, 8, 2, 14336, 4096)
        assert _lookup(1, group=64) == configs.default_config("moe", 1, 8, 2, 14336, 4096, 64)
        (tmp_path / "c.json").write_text(json.dumps({"format": 1, "device": "x"}))
        configs.clear_cache()
        with pytest.raises(ValueError, match="missing key 'triton'"):
            _lookup(1)
    finally:
        configs.clear_cache()


def test_lookup_never_splits_a_shared_expert_and_is_cached(tmp_path, monkeypatch):
    """T = 2 must not get a BLOCK_M 1 config (an expert picked by both tokens would be streamed twice)."""
    monkeypatch.setenv(configs.ENV_CONFIG_DIR, str(tmp_path))
    (tmp_path / "a.json").write_text(json.dumps(_table("cpu", configs.triton_version(), {1: 1})))
    configs.clear_cache()
    try:
        for T in range(2, 17):
            assert _lookup(T)["BLOCK_M"] >= T  # every expert's rows in one block
        assert _lookup(2) is _lookup(2)  # resolved once per T bucket
        assert _lookup(3) is _lookup(4)
    finally:
        configs.clear_cache()
    for T in range(1, 17):
        assert configs.default_config("moe", T, 8, 2, 14336, 4096)["BLOCK_M"] >= T


def test_config_defaults_have_one_source():
    flat = encode_moe_config({"BLOCK_M": 4})
    assert flat[1:] == [configs.GEMM_DEFAULTS[key] for _ in ("w13", "w2") for key in configs.GEMM_KEYS]
    for phase in ("decode", "prefill"):
        for g in (32, 64, 128):
            cands = configs.tuning_candidates(phase, g)
            assert cands and all(c[w]["BLOCK_K"] <= g for c in cands for w in ("w13", "w2"))
        assert len(configs.tuning_candidates(phase, 32)) < len(configs.tuning_candidates(phase, 128))
    for T in (1, 4, 16, 64, 512, 4096):
        for g in (32, 128):
            cfg = configs.default_config("moe", T, 8, 2, 14336, 4096, g)
            assert cfg["w13"]["BLOCK_K"] <= g and cfg["w2"]["BLOCK_K"] <= g
            assert set(cfg["w13"]) == set(configs.GEMM_DEFAULTS)


def test_shipped_tables_and_defaults():
    for f in configs.CONFIG_DIR.glob("*.json"):
        configs.validate_table(json.loads(f.read_text()), str(f))
    decode = configs.default_config("moe", 1, 8, 2, 14336, 4096)
    prefill = configs.default_config("moe", 4096, 8, 2, 14336, 4096)
    assert decode["BLOCK_M"] < 16 and decode["w2"]["SPLIT_K"] > 1 and prefill["BLOCK_M"] >= 64
    assert configs.default_config("linear", 1, 1, 1, 4096, 4096)["BLOCK_M"] == 1


# ---------------------------------------------------------------------------------------------------------
# the GPU benchmark script's CPU-runnable parts


def test_run_gpu_kernels_dry_run(tmp_path):
    from benchmarks.gpu import kernels as mod

    with pytest.raises(SystemExit):
        mod.parse_args(["--shapes", "nope"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--tune", "--device", "cpu"])
    out = tmp_path / "r.json"
    report = mod.main(["--dry-run", "--skip-baselines", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["dry_run"] and len(data["results"]) == 3 == len(report["results"])
    r = data["results"][0]
    assert {"ours_s", "bytes_per_s", "frac_of_copy_bw", "tflops", "frac_of_cublas", "config"} <= set(r)
    # the former row-major qweight layout, timed beside the panel layout, gives the same output
    assert all(r["layouts_equal"] and r["panel_speedup"] > 0 for r in data["results"])
    assert "| tiny | 1 |" in out.with_suffix(".md").read_text()


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.combine(torch.zeros(2, 4), 1, "triton")
    assert kernels.combine(torch.ones(2, 4), 1, "auto").sum() == 8  # auto = torch on a CPU


def test_tune_checks_every_candidate_before_timing_it(monkeypatch):
    """--tune runs each candidate once against the fp32 reference: a wrong output is recorded, never timed, and
    cannot be picked (a broken split-K fixup or tile would otherwise win by doing less)."""
    import types

    from benchmarks.gpu import kernels as mod

    good = {"BLOCK_M": 1, "w13": {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2}, "w2": {"BLOCK_N": 128, "SPLIT_K": 1}}
    bad = {**good, "w13": {**good["w13"], "SPLIT_K": 4}}
    monkeypatch.setattr(mod.kcfg, "tuning_candidates", lambda phase, group: [bad, good])
    forward = kernels.moe_forward

    def moe_forward(*args, config=None, **kw):  # the "bad" candidate computes something else
        y = forward(*args, config=config, **kw)
        return y * 1.5 if config is bad else y

    monkeypatch.setattr(mod.kernels, "moe_forward", moe_forward)
    timed = []
    monkeypatch.setattr(mod, "time_fn", lambda fn, dev, reps: timed.append(fn) or [1.0])
    result = mod.tune_point("tiny", 1, types.SimpleNamespace(device="cpu", dtype=torch.float32))
    wrong, right = result["candidates"]
    assert wrong["error"].startswith("wrong output") and "median_s" not in wrong
    assert right.get("error") is None and right["median_s"] == 1.0 and len(timed) == 1
    assert result["best"] is good
