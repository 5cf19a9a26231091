"""The tools on a Qwen3-MoE checkpoint with a dense layer between its MoE layers, end to end through the command
line: ``moeflow trace`` -> ``train-predictor`` (several kinds, skip-gate with the model's routers) ->
``eval-predictor`` -> ``simulate`` (the routers as gates) -> the trained predictors serving the model
(greedy tokens equal to resident)."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import make_family_checkpoint

from moeflow import MoEModel, OffloadConfig
from moeflow.cli import main
from moeflow.engine.loading import read_routers
from moeflow.trace import Trace

SHAPE = dict(num_hidden_layers=4, mlp_only_layers=[0, 2], num_experts=16, num_experts_per_tok=4,
             norm_topk_prob=True)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_tools")
    ckpt = make_family_checkpoint(root / "model", "qwen3_moe", seed=3, **SHAPE)
    g = torch.Generator().manual_seed(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": torch.randint(0, 97, (n,), generator=g).tolist()}) + "\n"
                               for n in (6, 9, 5, 8, 7, 6, 10, 5)))
    trace_path = root / "trace.safetensors"
    assert main(["trace", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(trace_path),
                 "--max-new-tokens", "6", "--hidden", "--quiet"]) == 0
    return ckpt, trace_path


def test_trace_holds_the_moe_layers_only(traced):
    ckpt, trace_path = traced
    trace = Trace.load(trace_path)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 16, 4)
    assert trace.hidden is not None and trace.hidden.shape[-1] == 64
    routers, top_k = read_routers(ckpt)
    assert top_k == 4 and [tuple(w.shape) for w in routers] == [(16, 64), (16, 64)]
    # the routers read for MoE layers 0 and 1 are decoder layers 1 and 3's
    model = MoEModel.from_pretrained(ckpt)
    assert torch.equal(routers[1], model.model.layers[3].mlp.gate.weight.float())


@pytest.mark.parametrize("kind", ["promoe", "duoserve", "finemoe", "skip-gate", "popularity"])
def test_train_eval_and_serve(traced, tmp_path, kind, capsys):
    ckpt, trace_path = traced
    out = tmp_path / f"{kind}.pt"
    args = ["train-predictor", "--kind", kind, "--trace", str(trace_path), "--out", str(out), "--eval-fraction",
            "0.25"]
    if kind in ("promoe", "duoserve"):
        args += ["--epochs", "2"]
    if kind == "skip-gate":
        args += ["--model", str(ckpt)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["eval-predictor", "--predictor", str(out), "--trace", str(trace_path), "--compact"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["kind"] == kind and report["pairs"] > 0 and 0.0 <= report["recall"] <= 1.0
    if kind in ("promoe", "duoserve", "finemoe"):
        ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(9))
        resident = MoEModel.from_pretrained(ckpt).generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
        model = MoEModel.from_pretrained(ckpt, offload=OffloadConfig(policy=kind, gpu_expert_slots=6,
                                                                      predictor_path=str(out)))
        try:
            got = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
        finally:
            model.close()
        assert torch.equal(got, resident)
        assert model.stats.prefill.prefetches + model.stats.decode.prefetches > 0


def test_simulate_with_the_models_routers(traced, capsys):
    ckpt, trace_path = traced
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace_path), "--policy", "lru,mixtral-offloading", "--slots", "4,16",
                 "--h2d-gbps", "25", "--expert-mb", "2.4", "--gates", str(ckpt), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert sorted((r["policy"], r["slots"]) for r in rows) == [("lru", 4), ("lru", 16), ("mixtral-offloading", 4),
                                                                ("mixtral-offloading", 16)]
    assert all(r["tpot_s"] > 0 and r["bytes_h2d"] > 0 for r in rows)


def test_qwen3_shaped_simulator_presets():
    from moeflow.sim import get_profile, simulate
    from moeflow.sim.profile import ProfileError, awq_expert_bytes
    from moeflow.trace.synthetic import gate_modules, synthesize_trace

    small, big = get_profile("qwen3-30b-pcie4-12gb"), get_profile("qwen3-235b-h100-pcie5")
    assert (small.num_layers, small.num_experts, small.top_k) == (48, 128, 8)
    assert (big.num_layers, big.num_experts, big.top_k) == (94, 128, 8)
    assert small.expert_bytes == awq_expert_bytes(2048, 768) and 2.2 < small.expert_bytes / 2**20 < 2.6
    assert big.expert_bytes == awq_expert_bytes(4096, 1536)
    assert big.max_slots() < 94 * 128 and small.max_slots() < 48 * 128  # neither fits whole in its GPU
    trace, gates = synthesize_trace(num_layers=48, num_experts=128, top_k=8, sequences=1, prompt_len=2, new_tokens=3)
    resident = simulate(trace, "resident", 48 * 128, small)
    lru = simulate(trace, "lru", 8, small, gates=gate_modules(gates))
    assert lru.bytes_h2d > 0 and lru.tpot_s > resident.tpot_s > 0
    with pytest.raises(ProfileError, match="num_layers: .* has 48, the profile 94"):
        simulate(trace, "lru", 8, big)
