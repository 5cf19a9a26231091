"""ExpertFlow: routing-path predictor, PLEC cache (policy "expertflow"), batched generation with rebatching."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import InputError, SchedulingError
from moeflow.offload.policies.expertflow import PLECEviction, PLECPredictor, PLECState
from moeflow.offload.policies.expertflow.predictor import batch_level_accuracy, batch_level_report
from moeflow.offload.predictors import (
    ExpertFlowPredictor,
    PredictorError,
    evaluate_held_out,
    held_out_rows,
    load_predictor,
    train_predictor,
)
from moeflow.tools.record import record_trace

LAYERS, EXPERTS = 3, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ef"), seed=3, num_local_experts=EXPERTS,
                                num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def trace(ckpt):
    model = MoEOffloadedMixtral.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    return record_trace(model, prompts, 6)


@pytest.fixture(scope="module")
def predictor_file(trace, tmp_path_factory):
    pred = train_predictor("expertflow", trace, epochs=4, seed=0)
    return pred.save(tmp_path_factory.mktemp("efp") / "expertflow.pt")


def padded_batch(n: int, seed: int, lo: int = 2, hi: int = 10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, width - length:] = torch.randint(3, 97, (length,), generator=g)
        mask[i, width - length:] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------- the predictor
def test_train_eval_save_load(trace, predictor_file):
    pred = load_predictor(predictor_file)
    assert isinstance(pred, ExpertFlowPredictor) and pred.kind == "expertflow"
    res = evaluate_held_out(pred, trace)
    assert res["tokens"] > 0 and res["pairs"] == res["tokens"] * LAYERS
    for key in ("exact_topk", "recall", "precision"):
        assert 0.0 <= res[key] <= 1.0
    assert res["mean_predicted"] == pytest.approx(2.0)
    report = batch_level_report(pred, held_out_rows(pred, trace))
    assert set(report) == {"1", "4", "16", "32"}
    for fig in report.values():
        assert 0.0 <= fig["accuracy"] <= 1.0 and 0.0 <= fig["recall"] <= 1.0
    # the file gives the same scores as the trained object
    again = train_predictor("expertflow", trace, epochs=4, seed=0)
    ctx = trace.token_ids[:9]
    assert torch.allclose(again.token_scores(ctx, 9), pred.token_scores(ctx, 9), atol=1e-5)
    assert pred.token_scores(ctx, 1).shape == (1, LAYERS, EXPERTS)


def test_batch_level_accuracy_reads_eq7_on_or_paths():
    actual = torch.zeros(4, 2, 4, dtype=torch.bool)
    actual[0, :, 0] = actual[1, :, 1] = actual[2, :, 0] = actual[3, :, 2] = True
    exact = batch_level_accuracy(actual, actual, 2)
    assert exact["accuracy"] == 1.0 and exact["exact"] == 1.0 and exact["recall"] == 1.0
    wrong = torch.zeros_like(actual)
    wrong[:, :, 3] = True  # every token predicted on expert 3 only
    res = batch_level_accuracy(wrong, actual, 4)
    # one batch: true OR = experts {0,1,2} in both layers, predicted {3}: 0 of 8 entries agree
    assert res["batches"] == 1 and res["accuracy"] == 0.0 and res["recall"] == 0.0


def test_predict_paths_or_of_tokens_and_checks(predictor_file):
    pred = load_predictor(predictor_file)
    ids, mask = padded_batch(3, seed=4)
    paths = pred.predict_paths(ids, mask)
    assert paths.shape == (3, LAYERS, EXPERTS) and paths.dtype == torch.bool
    assert bool((paths.sum(-1) >= 2).all())  # at least the top-2 of one token per layer
    last = pred.predict_paths(ids, mask, last_only=True)
    assert bool((last.sum(-1) == 2).all()) and bool((last <= paths).all())
    # padding is ignored: the same prompt alone gives the same path
    row = ids[0][mask[0] == 1][None]
    assert torch.equal(pred.predict_paths(row)[0], paths[0])
    with pytest.raises(PredictorError, match="attention_mask"):
        pred.predict_paths(ids, mask[:, 1:])
    with pytest.raises(PredictorError, match="vocabulary"):
        pred.predict_paths(torch.full((1, 3), 10_000))


def test_decode_scores_read_and_check_only_the_window(predictor_file):
    """A decode step encodes the last ``window`` tokens only, so only those are checked: its cost stays flat as
    the context grows, and a token outside the window changes nothing."""
    pred = load_predictor(predictor_file)
    ctx = torch.randint(3, 97, (pred.window + 5,), generator=torch.Generator().manual_seed(1))
    scores = pred.token_scores(ctx, 1)
    far = ctx.clone()
    far[0] = 10_000  # outside the window: never read
    assert torch.equal(pred.token_scores(far, 1), scores)
    near = ctx.clone()
    near[-1] = 10_000
    with pytest.raises(PredictorError, match="vocabulary"):
        pred.token_scores(near, 1)
    with pytest.raises(PredictorError, match="vocabulary"):
        pred.token_scores(near, 3)


def test_cli_train_and_eval(trace, tmp_path, capsys):
    from moeflow.cli.predictors import main

    path = trace.save(tmp_path / "t.safetensors")
    out = tmp_path / "ef.pt"
    assert main(["train-predictor", "--kind", "expertflow", "--trace", str(path), "--out", str(out),
                 "--epochs", "2"]) == 0
    capsys.readouterr()
    assert main(["eval-predictor", "--predictor", str(out), "--trace", str(path), "--compact"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "expertflow" and "exact_topk" in result and "recall" in result
    assert set(result["batch_level"]) == {"1", "4", "16", "32"}


# ---------------------------------------------------------------------------------------------- PLEC order
def test_plec_correction_order_misprefetched_before_finished():
    state = PLECState(num_layers=4, num_experts=4)
    ev = PLECEviction(state)
    state.new_pass({0: [0, 1], 1: [0, 1], 2: [2], 3: [3]})
    for key in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (3, 3)]:
        ev.loaded(key)  # prefetched ahead of their gates
    assert state.prefetched == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (3, 3)}
    # layer 0's gate needs 0 only: (0, 1) was mis-prefetched; layer 1's gate needs 0 and 2 (a miss)
    state.layer_now = 0
    ev.access((0, 0))
    state.layer_now = 1
    ev.access((1, 0))
    ev.access((1, 2))
    ev.loaded((1, 2))  # the miss, loaded on demand: not a prefetch
    assert (1, 2) not in state.prefetched
    finished = [(0, 0)]
    mis = [(0, 1)]
    planned_ahead = [(2, 2), (3, 3)]
    idle_ahead = [(2, 0)]
    cands = finished + planned_ahead + idle_ahead + mis
    assert ev.victim(cands, 1) == (0, 1)  # mis-prefetched first
    assert ev.victim([k for k in cands if k not in mis], 1) == (2, 0)  # then predicted idle for this step
    assert ev.victim(finished + planned_ahead, 1) == (0, 0)  # then finished this step
    assert ev.victim(planned_ahead, 1) == (3, 3)  # planned experts last, the farthest layer first
    # the miss of layer 1 took mis-prefetched (1, 1) over finished (0, 0) when both were candidates
    assert ev.victim([(0, 0), (1, 1)], 1) == (1, 1)


def test_plec_finished_experts_by_next_use():
    state = PLECState(num_layers=4, num_experts=2)
    ev = PLECEviction(state)
    state.new_pass({})
    for layer in range(4):
        state.layer_now = layer
        ev.access((layer, 0))
    # at layer 3 every layer is done: the layer just computed comes back last, so it goes first
    assert ev.victim([(0, 0), (1, 0), (2, 0)], 3) == (2, 0)
    assert ev.victim([(0, 0), (1, 0)], 3) == (1, 0)


def test_plec_budget_never_evicts_planned():
    class Slot:
        def __init__(self, key, task=None, pins=0):
            self.key, self.task, self.pins = key, task, pins

        @property
        def in_use(self):
            return self.pins > 0

    class Cache:
        def __init__(self, keys):
            self.slots = [Slot(k) for k in keys]

        def lookup(self, key):
            return next((s for s in self.slots if s.key == key), None)

        def empty_slots(self):
            return sum(1 for s in self.slots if s.key is None)

        def _evictable(self):
            return [s.key for s in self.slots if s.key is not None and s.task is None and not s.in_use]

        def evictable_count(self):
            return len(self._evictable())

        def is_evictable(self, key):
            return key in self._evictable()

    class Backend:
        def __init__(self, keys):
            self.cache = Cache(keys)

    state = PLECState(num_layers=3, num_experts=4)
    plec = PLECPredictor(predictor=None, state=state)
    plec.bind(Backend([(1, 0), (2, 1), (0, 3), None]))
    state.new_pass({0: [3], 1: [0, 1, 2], 2: [1, 2, 3]})
    # planned and resident: (1,0), (2,1), (0,3) (ahead of layer -1) stay; one empty slot: one prefetch
    assert plec._budget_targets(-1) == [(1, [1])]
    # after layer 0: (0, 3) is done and may go: two slots for the next planned experts, in layer order
    assert plec._budget_targets(0) == [(1, [1, 2])]


# ---------------------------------------------------------------------------------------------- invariant
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
def test_exact_tokens_batched_rebatched_expertflow(ckpt, predictor_file, transport):
    ids, mask = padded_batch(5, seed=1)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=6,
                                                             eos_token_id=[])
    for slots in (2, 5, LAYERS * EXPERTS):
        model = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=slots, predictor_path=str(predictor_file), transport=transport,
            random_delay_ms=0.5))
        assert isinstance(model.experts.predictor, PLECPredictor)
        for m in (None, 2, 3):
            # micro-batches are grouped by the backend's predict_paths (PLEC's predictor) when m is given
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], micro_batch_size=m)
            assert torch.equal(out, ref), (slots, m)
        assert model.stats.decode.prefetches > 0 or slots == LAYERS * EXPERTS
        model.experts.cache.check()


def test_expertflow_policy_needs_a_predictor_file(ckpt, tmp_path):
    with pytest.raises(SchedulingError, match="expertflow"):
        MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(policy="expertflow", gpu_expert_slots=4))
    with pytest.raises(SchedulingError, match="predictor_path"):
        MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=4, predictor_path=str(tmp_path / "missing.pt")))


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_batched_generation(ckpt):
    model = MoEOffloadedMixtral.from_pretrained(ckpt)
    ids, mask = padded_batch(4, seed=2)
    ctx = model.config.max_position_embeddings
    with pytest.raises(InputError, match="max_position_embeddings"):
        model.generate(torch.ones((2, ctx + 1), dtype=torch.long), max_new_tokens=1)
    with pytest.raises(InputError, match="max_position_embeddings"):
        model.generate(torch.ones((2, ctx - 2), dtype=torch.long), max_new_tokens=4)
    with pytest.raises(InputError, match="empty"):
        model.generate(torch.zeros((2, 0), dtype=torch.long), max_new_tokens=2)
    empty_row = mask.clone()
    empty_row[1] = 0
    with pytest.raises(InputError, match="no real token"):
        model.generate(ids, attention_mask=empty_row, max_new_tokens=2)
    for m in (0, 5, -1, 2.0):
        with pytest.raises(ValueError, match="micro_batch_size"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, micro_batch_size=m)
    with pytest.raises(InputError, match="attention_mask has shape"):
        model.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    with pytest.raises(InputError, match="attention_mask has shape"):
        model.generate(ids, attention_mask=mask[:3], max_new_tokens=2)
    right = torch.flip(mask, dims=[1])
    right[:, 0] = 1
    with pytest.raises(InputError, match="left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(InputError, match="0 \\(padding\\) or 1"):
        model.generate(ids, attention_mask=mask * 2, max_new_tokens=2)
