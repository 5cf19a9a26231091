"""Predictors plugged into the offloading runtime through policy factories: same tokens as resident."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.offload.predictors import PredictorError, PredictorMismatchError, train_predictor
from moeflow.offload.predictors.runtime import build_predictor, finemoe_eviction_score, predictor_factory
from moeflow.tools.record import record_trace

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41]])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    ckpt = make_tiny_checkpoint(root / "m", seed=2, num_hidden_layers=4, num_local_experts=8)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt)
    trace = record_trace(ref, [[1, 2, 3, 4, 5], [9, 10, 11], [12, 13, 14, 15], [20, 3, 7]], max_new_tokens=5,
                         hidden=True)
    files = {}
    for kind, opts in (("duoserve", {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}), ("promoe", {"epochs": 2}),
                       ("finemoe", {})):
        files[kind] = train_predictor(kind, trace, eval_fraction=0.25, **opts).save(root / f"{kind}.pt")
    want = ref.generate(PROMPT, max_new_tokens=6, do_sample=False)
    return ckpt, files, want


@pytest.mark.parametrize("kind,from_file", [("skip-gate", False), ("duoserve", True), ("promoe", True),
                                            ("finemoe", True), ("finemoe", False)])
def test_predictor_policy_keeps_exact_tokens(setup, kind, from_file):
    from moeflow.offload.policies import PolicySpec, evict, register_policy, unregister_policy

    ckpt, files, want = setup
    name = f"test-predictor-{kind}-{from_file}"
    register_policy(PolicySpec(name, eviction=evict("lru"), predictor=predictor_factory(
        kind, files[kind] if from_file else None)))
    try:
        model = MoEOffloadedMixtral.from_pretrained(
            ckpt, offload=OffloadConfig(gpu_expert_slots=6, policy=name, transport="random-delay"))
        got = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    finally:
        unregister_policy(name)  # leave the registry as other tests expect it
    assert torch.equal(got, want)
    assert model.stats.decode.prefetches > 0 or kind == "finemoe"
    if kind == "finemoe":
        pred = model.experts.predictor
        assert len(pred.store) > (16 if from_file else 0)  # it filled as it served
        assert finemoe_eviction_score(pred)((3, 0), 0) >= 0.0


def test_build_predictor_checks_the_model(setup):
    _, files, _ = setup
    gates = [torch.nn.Linear(64, 8, bias=False) for _ in range(4)]
    ctx = SimpleNamespace(num_layers=4, num_experts=8, top_k=2, gates=gates, device="cpu")
    assert build_predictor("duoserve", ctx, files["duoserve"]).kind == "duoserve"
    with pytest.raises(PredictorError, match="holds a 'duoserve' predictor, not 'promoe'"):
        build_predictor("promoe", ctx, files["duoserve"])
    with pytest.raises(PredictorError, match="learned from a trace"):
        build_predictor("duoserve", ctx)
    other = SimpleNamespace(num_layers=4, num_experts=6, top_k=2, gates=gates[:1] * 4, device="cpu")
    with pytest.raises(PredictorMismatchError, match="num_experts=8 but the model has num_experts=6"):
        build_predictor("promoe", other, files["promoe"])
