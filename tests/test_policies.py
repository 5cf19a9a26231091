"""The predictor presets (duoserve, promoe, finemoe, auto) keep the exact-token invariant, find their
predictor files, and refuse bad input with clear errors."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.offload.policies import choose_policy
from moeflow.offload.predictors import train_predictor
from moeflow.tools.record import record_trace

LAYERS, EXPERTS, TOP_K = 3, 4, 2
NEW_TOKENS = 8
PRESETS = ("duoserve", "promoe", "finemoe", "auto")


pytestmark = pytest.mark.usefixtures("one_thread")


def train_tiny_predictors(ckpt, out_dir, model=None) -> dict:
    """duoserve / promoe / finemoe from a short trace of ``ckpt`` (seconds), written to ``out_dir/<kind>.pt``."""
    model = model or MoEOffloadedMixtral.from_pretrained(ckpt)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6, 8, 5)]
    trace = record_trace(model, prompts, max_new_tokens=6, hidden=True)
    files = {}
    for kind, opts in (("duoserve", {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}), ("promoe", {"epochs": 2}),
                       ("finemoe", {"capacity": 64})):
        files[kind] = train_predictor(kind, trace, eval_fraction=0.2, **opts).save(out_dir / f"{kind}.pt")
    return files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    path = make_tiny_checkpoint(root / "m", seed=5, num_hidden_layers=LAYERS, num_local_experts=EXPERTS,
                                num_experts_per_tok=TOP_K)
    resident = MoEOffloadedMixtral.from_pretrained(path)
    files = train_tiny_predictors(path, path / "predictors", resident)  # where the presets look by default
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the prefill needs every expert through the ring
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return path, files, ids, mask, expected


def _generate(path, ids, mask, new_tokens=NEW_TOKENS, **config):
    model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(**config))
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False), model
    finally:
        model.experts.close()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", PRESETS)
def test_greedy_tokens_equal_resident(tiny, policy, transport):
    path, _, ids, mask, expected = tiny
    prefetched = 0
    for n_slots in range(TOP_K, LAYERS * EXPERTS + 1):
        out, model = _generate(path, ids, mask, policy=policy, gpu_expert_slots=n_slots, transport=transport,
                               random_delay_ms=0.3, seed=n_slots)
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
        s = model.stats
        assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        prefetched += s.prefill.prefetches + s.decode.prefetches
    assert prefetched > 0, f"{policy} never prefetched"


def test_presets_are_what_the_papers_describe(tiny):
    path, *_ = tiny
    from moeflow.offload.policies import FineMoERuntime, OverlappedPredictor

    m = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="duoserve", gpu_expert_slots=5))
    assert isinstance(m.experts.predictor, OverlappedPredictor) and m.experts.predictor.kind == "duoserve"
    assert m.experts.prefill_ring == TOP_K  # prefill streams through a ring of k slots
    m = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="promoe", gpu_expert_slots=6))
    assert m.experts.predictor.kind == "promoe" and m.experts.predictor.distance == 2  # stride
    assert m.experts.cache.layer_quota == 2  # per-layer LRU
    m = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="finemoe", gpu_expert_slots=6))
    pred = m.experts.predictor
    assert isinstance(pred, FineMoERuntime) and m.experts.cache.policy.name == "priority+lfu"
    before = len(pred.store)
    m.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=4, do_sample=False)
    assert len(pred.store) > before  # the store fills as it serves
    # the embedding hook searched the store and prefetched the first d layers before layer 0 ran
    assert m.stats.prefill.prefetches > 0 and pred.predictor._query_sem is not None


def test_finemoe_needs_no_file(tiny, tmp_path):
    path, _, ids, mask, expected = tiny
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("predictors"))
    out, model = _generate(bare, ids, mask, policy="finemoe", gpu_expert_slots=4, transport="random-delay")
    assert torch.equal(out, expected)
    assert len(model.experts.predictor.store) > 0
    # and auto falls back to it without files
    out, model = _generate(bare, ids, mask, policy="auto", gpu_expert_slots=LAYERS * TOP_K)
    assert torch.equal(out, expected) and model.experts.policy_name == "finemoe"


def test_predictor_path_overrides_the_default(tiny, tmp_path):
    path, files, ids, mask, expected = tiny
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.copy(files["promoe"], elsewhere)
    out, model = _generate(path, ids, mask, policy="promoe", gpu_expert_slots=5, predictor_path=str(elsewhere))
    assert torch.equal(out, expected)


def _ctx(n_slots, checkpoint_dir=None, predictor_path=None):
    return SimpleNamespace(n_slots=n_slots, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K,
                           checkpoint_dir=checkpoint_dir, config=OffloadConfig(predictor_path=predictor_path))


def test_auto_choice(tiny, tmp_path):
    path, files, *_ = tiny
    one_token = LAYERS * TOP_K  # experts one decode token needs
    assert choose_policy(_ctx(LAYERS * EXPERTS, path)) == "lru"  # everything fits: nothing to predict
    assert choose_policy(_ctx(one_token, path)) == "promoe"
    assert choose_policy(_ctx(one_token - 1, path)) == "duoserve"
    assert choose_policy(_ctx(one_token, tmp_path)) == "finemoe"  # no files: the ones that need none
    assert choose_policy(_ctx(one_token - 1, tmp_path)) == "mixtral-offloading"
    assert choose_policy(_ctx(one_token, tmp_path, str(files["promoe"]))) == "promoe"
    assert choose_policy(_ctx(one_token - 1, tmp_path, str(files["promoe"]))) == "mixtral-offloading"


def test_missing_predictor_file_says_how_to_train(tiny, tmp_path):
    path, *_ = tiny
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("predictors"))
    for policy in ("duoserve", "promoe"):
        with pytest.raises(SchedulingError, match=rf"needs a trained {policy} predictor: no predictor file at "
                                                  rf".*moeflow train-predictor --kind {policy}"):
            MoEOffloadedMixtral.from_pretrained(bare, offload=OffloadConfig(policy=policy, gpu_expert_slots=4))
    with pytest.raises(SchedulingError, match="predictor_path='nowhere.pt': no such file"):
        MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="promoe", gpu_expert_slots=4,
                                                                        predictor_path="nowhere.pt"))


def test_predictor_of_another_kind_or_model_is_refused(tiny, tmp_path):
    path, files, *_ = tiny
    with pytest.raises(SchedulingError, match="needs a promoe predictor, but .*duoserve.pt holds a 'duoserve'"):
        MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(
            policy="promoe", gpu_expert_slots=4, predictor_path=str(files["duoserve"])))
    other = make_tiny_checkpoint(tmp_path / "other", seed=1, num_hidden_layers=LAYERS, num_local_experts=6,
                                 num_experts_per_tok=TOP_K)
    for kind in ("duoserve", "promoe", "finemoe"):
        with pytest.raises(SchedulingError, match="built for another model: num_experts=4 but the model has "
                                                  "num_experts=6"):
            MoEOffloadedMixtral.from_pretrained(other, offload=OffloadConfig(
                policy=kind, gpu_expert_slots=4, predictor_path=str(files[kind])))
    not_a_predictor = tmp_path / "junk.pt"
    not_a_predictor.write_bytes(b"not a predictor")
    with pytest.raises(SchedulingError, match="not a moeflow predictor"):
        MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(
            policy="duoserve", gpu_expert_slots=4, predictor_path=str(not_a_predictor)))


def test_unknown_policy_is_refused(tiny):
    path, *_ = tiny
    with pytest.raises(SchedulingError, match="unknown offload policy 'duoserv'; known policies: .*'duoserve'"):
        MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="duoserv", gpu_expert_slots=4))
