"""Expert predictors: accuracy on a trace with known structure, FineMoE's formulas, files, bad inputs."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from moeflow.errors import MoeflowError
from moeflow.offload.policies.duoserve.predictor import PAPER_WIDTHS, affinity_matrices, scaled_widths
from moeflow.offload.policies.finemoe.predictor import (
    eviction_priority,
    prefetch_priority,
    select_experts,
    similarity_threshold,
)
from moeflow.offload.predictors import (
    DuoServePredictor,
    ExpertMapStore,
    FineMoEPredictor,
    ModelShape,
    PopularityPredictor,
    PredictorError,
    PredictorMismatchError,
    ProMoEPredictor,
    SkipGatePredictor,
    evaluate,
    evaluate_held_out,
    held_out_rows,
    load_predictor,
    train_predictor,
)
from moeflow.trace.synthetic import synthetic_trace

FAST = {
    "duoserve": {"epochs": 10, "batch_size": 64, "lr": 3e-3, "widths": [128, 64, 32, 32, 16, 16]},
    "promoe": {"epochs": 10},
    "finemoe": {},
}


@pytest.fixture(scope="module")
def synth():
    return synthetic_trace(num_sequences=32, tokens_per_sequence=24, seed=0)


@pytest.fixture(scope="module")
def trained(synth):
    trace, gates = synth
    out = {kind: train_predictor(kind, trace, eval_fraction=0.25, **opts) for kind, opts in FAST.items()}
    sg = SkipGatePredictor.from_gates(list(gates), trace.top_k, distance=1, popularity=out["duoserve"].popularity)
    sg.train_info = out["duoserve"].train_info
    out["skip-gate"] = sg
    return out


# ---------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("kind", ["skip-gate", "duoserve", "promoe", "finemoe"])
def test_beats_popularity_on_structured_trace(synth, trained, kind):
    trace, _ = synth
    result = evaluate_held_out(trained[kind], trace)
    base = result["popularity"]
    assert result["held_out_sequences"] == 8
    assert result["recall"] >= base["recall"] + 0.2, (result, base)
    assert result["exact_topk"] >= base["exact_topk"]
    assert result["at_least_one"] >= base["at_least_one"]
    assert result["recall"] > 0.7


def test_popularity_is_eq2(synth):
    trace, _ = synth
    p = PopularityPredictor.fit(trace)
    counts = torch.zeros(trace.num_layers, trace.num_experts)
    for layer in range(trace.num_layers):
        counts[layer] = torch.bincount(trace.topk_ids[:, layer].reshape(-1).long(), minlength=trace.num_experts)
    torch.testing.assert_close(p.popularity, counts / counts.sum(1, keepdim=True))
    assert torch.equal(p.predict(3), p.popularity[3:4])


def test_affinity_is_eq3():
    # two tokens, two layers: token 0 picks {0,1} then {2,3}; token 1 picks {0,2} then {2,1}
    topk = torch.tensor([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])
    a = affinity_matrices(topk, 4)[0]
    torch.testing.assert_close(a[0], torch.tensor([0.0, 0.25, 0.5, 0.25]))  # expert 0 -> {2,3} and {2,1}
    torch.testing.assert_close(a[1], torch.tensor([0.0, 0.0, 0.5, 0.5]))
    torch.testing.assert_close(a[3], torch.full((4,), 0.25))  # never selected: uniform
    torch.testing.assert_close(a.sum(-1), torch.ones(4))


def test_duoserve_structure_and_state():
    assert scaled_widths(32 * 8 + 8 + 16) == PAPER_WIDTHS  # Mixtral-8x7B: the paper's 2048 -> 64
    p = DuoServePredictor(ModelShape(32, 8, 2, 4096))
    linears = [m for m in p.mlp if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 and [m.out_features for m in linears] == [*PAPER_WIDTHS, 8]
    assert sum(isinstance(m, torch.nn.BatchNorm1d) for m in p.mlp) == 6
    assert all(m.p == 0.1 for m in p.mlp if isinstance(m, torch.nn.Dropout))
    small = DuoServePredictor(ModelShape(4, 8, 2, 64))
    assert len(small.widths) == 6 and small.widths[0] < 2048
    path = torch.tensor([[[0, 1], [2, 3]]])  # layers 0-1 of one token -> state for target 2
    s = small.state_vector(path, 2)
    assert s.shape == (1, 4 * 8 + 8 + 2 * 8)
    h = s[0, :32].reshape(4, 8)
    assert h[0, [0, 1]].tolist() == [1, 1] and h[1, [2, 3]].tolist() == [1, 1] and h[2:].sum() == 0


def test_promoe_default_is_stride(synth, trained):
    assert trained["promoe"].distance == 2  # one beyond the next layer
    assert trained["promoe"].train_info.eval_fraction == 0.25
    assert len(trained["promoe"].mlps) == synth[0].num_layers - 2


# ---------------------------------------------------------------------- FineMoE formulas
def test_delta_threshold_and_selection():
    assert similarity_threshold(1.0) == 0.0 and similarity_threshold(-0.5) == 1.0
    assert math.isclose(float(similarity_threshold(0.3)), 0.7, rel_tol=1e-6)
    p = torch.tensor([[0.4, 0.1, 0.3, 0.2]])
    assert select_experts(p, 0.0, 1)[0].tolist() == [True, False, False, False]
    assert select_experts(p, 0.0, 2)[0].tolist() == [True, False, True, False]  # at least k
    assert select_experts(p, 0.5, 1)[0].tolist() == [True, False, True, False]  # 0.4 < 0.5 <= 0.7
    assert select_experts(p, 0.7, 1)[0].tolist() == [True, False, True, False]  # reaching delta is enough
    assert select_experts(p, 0.75, 1)[0].tolist() == [True, False, True, True]
    assert select_experts(p, 1.0, 1)[0].all()
    rows = select_experts(torch.cat([p, p]), torch.tensor([0.0, 0.95]), 1)
    assert rows.sum(1).tolist() == [1, 4]


def test_priorities():
    assert math.isclose(float(prefetch_priority(0.6, layer=5, layer_now=3)), 0.3, rel_tol=1e-6)
    assert float(prefetch_priority(0.6, 4, 3)) > float(prefetch_priority(0.6, 6, 3))
    with pytest.raises(ValueError):
        prefetch_priority(0.5, 3, 3)
    assert math.isclose(float(eviction_priority(0.5, 4)), 0.5)
    assert float(eviction_priority(0.0, 3)) == math.inf
    assert float(eviction_priority(0.9, 10)) < float(eviction_priority(0.9, 1))  # frequent experts stay


def _unit(*xs):
    v = torch.tensor(xs, dtype=torch.float32)
    return v / v.norm()


def test_store_dedup_replaces_the_most_redundant_map():
    store = ExpertMapStore(num_layers=2, num_experts=2, hidden_size=2, capacity=3, distance=1)
    maps = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])
    sems = torch.stack([_unit(1, 0), _unit(0, 1), _unit(1, 1)])
    assert store.add(maps, sems) == [0, 1, 2] and len(store) == 3
    new_map = torch.tensor([[[0.1, 0.9], [0.0, 1.0]]])
    new_sem = _unit(0.2, 1)[None]
    rdy = store.redundancy(new_map, new_sem)[0]
    flat = new_map.reshape(1, -1)
    for y in range(3):
        traj = torch.nn.functional.cosine_similarity(flat, maps[y].reshape(1, -1))[0]
        sem = torch.nn.functional.cosine_similarity(new_sem, sems[y : y + 1])[0]
        assert math.isclose(float(rdy[y]), float(0.5 * sem + 0.5 * traj), rel_tol=1e-5)  # d/L, (L-d)/L
    assert store.add(new_map, new_sem) == [1]  # map 1 is the most redundant with the new one
    assert len(store) == 3 and store.replaced == 1
    torch.testing.assert_close(store.maps[1], new_map[0])
    torch.testing.assert_close(store.maps[0], maps[0])
    torch.testing.assert_close(store.maps[2], maps[2])


def _two_map_predictor(distance=2, **kw):
    shape = ModelShape(num_layers=4, num_experts=4, top_k=1, hidden_size=4)
    pred = FineMoEPredictor(shape, distance=distance, online=False, **kw)
    a = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(4, 4)  # map A: expert 0 everywhere
    b = torch.tensor([0.1, 0.1, 0.1, 0.7]).expand(4, 4)  # map B: expert 3 everywhere
    pred.store.add(torch.stack([a, b]), torch.stack([_unit(1, 0, 0, 0), _unit(0, 1, 0, 0)]))
    return pred, a, b


def test_semantic_search_for_first_layers_then_trajectory():
    pred, a, b = _two_map_predictor(distance=2)
    pred.begin_iteration(_unit(1, 0, 0, 0)[None])  # semantically like A
    for t in (0, 1):  # layers before the distance: semantic search
        torch.testing.assert_close(pred.predict(t), a[t][None])
        assert math.isclose(float(pred.search_score(t)[0]), 1.0, rel_tol=1e-5)
    pred.observe(0, None, b[0][None], torch.tensor([[3]]))  # but routes like B
    torch.testing.assert_close(pred.predict(2), b[2][None])  # trajectory of layer 0 -> layer 2
    assert pred.predicted_mask(pred.predict(2), 2)[0].tolist() == [False, False, False, True]
    with pytest.raises(PredictorError, match="layer 1 observed first"):
        pred.predict(3)


def test_delta_grows_as_the_match_weakens():
    pred, a, _ = _two_map_predictor(distance=2)
    pred.store.maps[0] = torch.tensor([0.4, 0.3, 0.2, 0.1])  # a flatter map A
    pred.begin_iteration(_unit(1, 0, 0, 0)[None])  # exact match: delta 0 -> k = 1 expert
    assert pred.predicted_mask(pred.predict(0), 0).sum() == 1
    pred.begin_iteration(torch.tensor([[0.5, 0.0, math.sqrt(0.75), 0.0]]))  # cosine 0.5 -> delta 0.5
    scores = pred.predict(0)
    assert math.isclose(float(pred.search_score(0)[0]), 0.5, rel_tol=1e-5)
    assert pred.predicted_mask(scores, 0)[0].tolist() == [True, True, False, False]  # 0.4 + 0.3 >= 0.5
    pred.begin_iteration(torch.tensor([[0.0, 0.0, 1.0, 0.0]]))  # orthogonal: delta 1 -> every expert
    assert pred.predicted_mask(pred.predict(0), 0).all()


def test_online_fill_and_eviction_priority():
    pred, a, b = _two_map_predictor(distance=1)
    pred.online = True
    pred.begin_iteration(_unit(0, 0, 1, 0)[None])
    for layer in range(4):
        pred.observe(layer, None, a[layer][None], torch.tensor([[0]]))
        if layer + 1 < 4:
            pred.predict(layer + 1)
    pred.end_iteration()
    assert len(pred.store) == 3  # the served iteration was published
    assert pred.freq[:, 0].tolist() == [1, 1, 1, 1]
    p = float(pred.guidance[2, 0])
    assert math.isclose(pred.eviction_priority(2, 0), 1 / (p * 1.0), rel_tol=1e-5)
    assert pred.eviction_priority(2, 1) == math.inf  # never visited
    assert math.isclose(pred.eviction_score((2, 0)), p)


def test_async_search_matches_sync(synth):
    trace, _ = synth
    train, held = trace.split(0.25)
    sync = FineMoEPredictor.fit(train, distance=2)
    asyn = FineMoEPredictor.fit(train, distance=2)
    asyn.start_async()
    try:
        assert asyn.is_async
        a = evaluate(asyn, held).as_dict()
    finally:
        asyn.close()
    s = evaluate(sync, held).as_dict()
    for key in ("exact_topk", "recall", "precision", "mean_predicted"):
        assert a[key] == s[key]
    assert a["first_layers"]["recall"] == s["first_layers"]["recall"]
    assert len(asyn.store) == len(sync.store) > len(train)  # both filled as they served


def test_warm_store_respects_capacity(synth):
    trace, _ = synth
    p = FineMoEPredictor.fit(trace, capacity=50)
    assert len(p.store) == 50 and p.store.replaced == len(trace) - 50
    assert p.distance == 3  # the paper's distance for Mixtral fits this 4-layer model


# ---------------------------------------------------------------------- runtime adapter
def test_propose_adapter(synth, trained):
    trace, _ = synth
    x = trace.hidden[:1, 0].float()
    pro = trained["promoe"]
    (target, ids), = pro.propose(0, x)  # a fixed shape [E]: the selected experts first, the rest -1
    assert target == 2 and ids.numel() == trace.num_experts and int((ids >= 0).sum()) == trace.top_k
    assert trained["skip-gate"].propose(3, trace.hidden[:1, 3].float()) == []  # nothing beyond the last layer
    duo = trained["duoserve"]
    duo.reset()
    with pytest.raises(PredictorError, match="observe"):
        duo.propose(0, x)
    (target, ids), = duo.observe_and_propose(0, x, trace.probs[:1, 0].float(), trace.topk_ids[:1, 0])
    assert target == 1 and int((ids >= 0).sum()) == 2 and bool((ids[2:] == -1).all())
    batch = trace.hidden[:5, 0].float()  # several tokens: union ranked by summed priority
    (_, ids), = pro.propose(0, batch, max_experts=3)
    assert ids.numel() == 3


# ---------------------------------------------------------------------- files and bad inputs
@pytest.mark.parametrize("kind", ["skip-gate", "duoserve", "promoe", "finemoe"])
def test_save_load_round_trip(synth, trained, kind, tmp_path):
    trace, _ = synth
    pred = trained[kind]
    path = pred.save(tmp_path / f"{kind}.pt")
    back = load_predictor(path, expect=ModelShape.from_trace(trace))
    assert type(back) is type(pred) and back.distance == pred.distance
    assert back.train_info.eval_seq_ids == pred.train_info.eval_seq_ids
    rows = held_out_rows(pred, trace)
    assert evaluate(back, rows).as_dict()["recall"] == evaluate(pred, rows).as_dict()["recall"]


def test_predictor_for_another_model_is_refused(synth, trained, tmp_path):
    trace, _ = synth
    path = trained["duoserve"].save(tmp_path / "d.pt")
    with pytest.raises(PredictorMismatchError, match="num_experts=8 but the model has num_experts=6"):
        load_predictor(path, expect=ModelShape(4, 6, 2, 32))
    with pytest.raises(PredictorMismatchError, match="num_layers=4 .*num_layers=32.*top_k=2 .*top_k=1"):
        load_predictor(path, expect=ModelShape(32, 8, 1, 32))
    with pytest.raises(PredictorMismatchError, match="hidden_size=32 but the model has hidden_size=4096"):
        load_predictor(trained["promoe"].save(tmp_path / "p.pt"), expect=ModelShape(4, 8, 2, 4096))
    other, _ = synthetic_trace(num_sequences=2, tokens_per_sequence=4, num_layers=3, num_experts=8)
    with pytest.raises(PredictorMismatchError, match="num_layers=4 but the trace .* has num_layers=3"):
        evaluate_held_out(trained["duoserve"], other)


def test_bad_predictor_files(tmp_path, trained):
    with pytest.raises(PredictorError, match="does not exist"):
        load_predictor(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(PredictorError, match="cannot read"):
        load_predictor(tmp_path / "junk.pt")
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(PredictorError, match="not a moeflow predictor"):
        load_predictor(tmp_path / "other.pt")
    blob = torch.load(trained["duoserve"].save(tmp_path / "d.pt"), weights_only=True)
    blob["kind"] = "oracle"
    torch.save(blob, tmp_path / "k.pt")
    with pytest.raises(PredictorError, match="unknown predictor kind 'oracle'"):
        load_predictor(tmp_path / "k.pt")
    blob["kind"] = "duoserve"
    blob["state"]["affinity"] = blob["state"]["affinity"][:1]
    torch.save(blob, tmp_path / "a.pt")
    with pytest.raises(PredictorError, match="'affinity' has shape"):
        load_predictor(tmp_path / "a.pt")


def test_bad_observations(trained, synth):
    trace, _ = synth
    p = trained["duoserve"]
    p.reset()
    assert isinstance(PredictorError("x"), MoeflowError)
    with pytest.raises(PredictorError, match="last dimension 6"):
        p.observe(0, None, torch.rand(1, 6), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(PredictorError, match="layer outside"):
        p.observe(4, None, torch.rand(1, 8), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(PredictorError, match="needs the routing"):
        p.observe(0, None, None, None)
    with pytest.raises(PredictorError, match="needs layer 1 observed"):
        p.reset() or p.predict(2)
    with pytest.raises(PredictorError, match="needs the MoE-layer input"):
        trained["promoe"].observe(0, None, None, None)
    with pytest.raises(ValueError, match="distance"):
        DuoServePredictor(ModelShape(4, 8, 2, 32), distance=4)


def test_training_needs_the_right_tensors(synth):
    trace, _ = synth
    bare = trace.rows(torch.arange(len(trace)))
    bare.hidden = bare.embed = None
    with pytest.raises(PredictorError, match="no 'hidden' tensor"):
        train_predictor("promoe", bare)
    with pytest.raises(PredictorError, match="no 'embed' tensor"):
        train_predictor("finemoe", bare)
    with pytest.raises(PredictorError, match="--model"):
        train_predictor("skip-gate", bare)
    with pytest.raises(PredictorError, match="unknown predictor kind"):
        train_predictor("lstm", bare)
    assert ProMoEPredictor.needs_hidden and not DuoServePredictor.needs_hidden


def test_held_out_rows(synth, trained):
    trace, _ = synth
    pred = trained["duoserve"]
    rows = held_out_rows(pred, trace)
    assert sorted(rows.sequence_ids()) == sorted(pred.train_info.eval_seq_ids)
    assert not set(rows.sequence_ids()) & set(pred.train_info.train_seq_ids)
    other, _ = synthetic_trace(num_sequences=3, tokens_per_sequence=4, seed=5)
    assert len(held_out_rows(pred, other)) == len(other)  # a separately recorded trace: every row


def test_train_and_eval_commands(synth, tmp_path, capsys):
    from moeflow.cli.predictors import register

    trace, _ = synth
    trace_path = trace.save(tmp_path / "t.safetensors")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    for kind, extra in (("promoe", ["--epochs", "10"]), ("finemoe", ["--capacity", "200"])):
        out = tmp_path / f"{kind}.pt"
        args = parser.parse_args(["train-predictor", "--kind", kind, "--trace", str(trace_path), "--out", str(out),
                                  *extra])
        assert args.func(args) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kind"] == kind and info["held_out_sequences"] == 4
        args = parser.parse_args(["eval-predictor", "--predictor", str(out), "--trace", str(trace_path)])
        assert args.func(args) == 0
        result = json.loads(capsys.readouterr().out)
        for key in ("exact_topk", "at_least_one", "recall", "precision"):
            assert 0.0 <= result[key] <= 1.0 and 0.0 <= result["popularity"][key] <= 1.0
        assert result["held_out_sequences"] == 4 and result["recall"] > result["popularity"]["recall"]
        assert "goodpred" not in result
    # ProMoE's GoodPred: Accuracy (precision) x FetchRate (the timing model: link-bound here, 1 ms / 2 ms per k)
    args = parser.parse_args(["eval-predictor", "--predictor", str(tmp_path / "promoe.pt"), "--trace", str(trace_path),
                              "--layer-ms", "1", "--expert-ms", "2"])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    gp = result["goodpred"]
    assert gp["fetch_rate"] == pytest.approx(0.5 / result["mean_predicted"])
    assert gp["goodpred"] == pytest.approx(result["precision"] * gp["fetch_rate"])
