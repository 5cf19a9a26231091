"""The simulator runs the learned policies as the engine does: it hands every pass's tokens, embeddings and
history to the backend (``begin_step``: FineMoE's semantic search, ExpertFlow's path plan) and loads their trained
predictors from a checkpoint (``simulate(predictor_dir=)``, ``moeflow simulate --predictors``)."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.errors import SchedulingError
from moeflow.moe.backend import StepInfo
from moeflow.offload.backend import OffloadedExperts
from moeflow.sim import custom_profile, simulate
from moeflow.tools.record import record_trace

PROFILE = custom_profile(h2d_gbps=20.0, expert_mb=40.0, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                         head_ms=0.4, sched_ms=0.05, latency_us=12.0)


@pytest.fixture(scope="module")
def trace():
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    try:
        prompts = [model.tokenizer.encode(p) for p in ("The \"with\" statement is used to wrap", "def add(a, b):")]
        return record_trace(model, prompts, max_new_tokens=6, hidden=True)
    finally:
        model.close()


def test_every_pass_reaches_begin_step_with_its_history(trace, monkeypatch):
    seen: list[StepInfo] = []
    begin = OffloadedExperts.begin_step
    monkeypatch.setattr(OffloadedExperts, "begin_step", lambda self, step: (seen.append(step), begin(self, step)))
    simulate(trace, "lru", 8, PROFILE, timeline=False)
    assert len(seen) == 2 * (1 + 5)  # per sequence: the prefill, then a pass per decode row
    for step in seen:
        ids, history = step.input_ids[0].tolist(), step.history_ids[0].tolist()
        assert history[-len(ids):] == ids and step.embeds is not None and step.embeds.shape[:2] == (1, len(ids))
        assert step.positions[0].tolist() == list(range(len(history) - len(ids), len(history)))
    assert [s.phase for s in seen[:2]] == ["prefill", "decode"]


@pytest.mark.parametrize("policy", ["duoserve", "promoe", "expertflow", "finemoe"])
def test_learned_policies_run_with_their_trained_predictors(trace, policy):
    r = simulate(trace, policy, 12, PROFILE, timeline=False, predictor_dir=embedded_model_path())
    assert r.prefetches > 0 and 0.0 < r.hit_rate <= 1.0 and r.tpot_s > 0


def test_a_learned_policy_without_its_file_names_it(trace):
    with pytest.raises(SchedulingError, match="needs a trained duoserve predictor"):
        simulate(trace, "duoserve", 12, PROFILE, timeline=False)


def test_the_cli_finds_the_predictors_of_the_gates_checkpoint(trace, tmp_path, capsys):
    from moeflow.cli import main

    path = tmp_path / "t.safetensors"
    trace.save(path)
    main(["simulate", "--trace", str(path), "--policy", "expertflow,lru", "--slots", "12", "--h2d-gbps", "20",
          "--expert-mb", "40", "--layer-ms", "0.3", "--expert-ms", "0.25", "--head-ms", "0.4",
          "--gates", str(embedded_model_path()), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["expertflow", "lru"] and out["skipped"] == []
    assert torch.tensor([r["prefetches"] for r in out["results"]]).tolist()[0] > 0
