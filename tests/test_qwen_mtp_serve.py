"""MTP speculation in the serving engine (``ContinuousEngine(num_speculative_tokens=k)``) on a tiny Qwen3-Next with
its MTP layer: the row's Gated DeltaNet states are rolled back past rejected drafts, so a greedy request alone gets
generate's plain greedy tokens, with the random MTP layer's drafts (mostly rejected) and with oracle drafts (every
third wrong: accepted runs, cut at the wrong ones), resident and under LRU with few slots. ~15 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from qwen_mtp_helpers import make_qwen_mtp_checkpoint
from test_engine_lookup import run

from moeflow import MoEModel, OffloadConfig
from moeflow.engine import continuous_mtp
from moeflow.engine.continuous import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen_mtp_checkpoint(tmp_path_factory.mktemp("qwen_mtp_serve"), seed=4)[0]


def greedy(model, ids: list[int]) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=[])[0, len(ids):] \
        .tolist()


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("offload", [None, "lru"])
def test_alone_greedy_tokens_with_the_mtp_layers_drafts(path, offload):
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy=offload, gpu_expert_slots=3)
                                     if offload else None)
    try:
        ids = prompt(1)
        want = greedy(model, ids)
        (seq,), _, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))], lookup=None, num_speculative_tokens=3,
                           rows=1)
    finally:
        model.close()
    assert seq.generated == want
    assert seq.draft_tokens > seq.accepted_tokens  # rejected drafts: the states were rolled back


def test_oracle_drafts_accepted_and_cut(path, monkeypatch):
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = prompt(2)
    want = greedy(model, ids)

    def propose(drafter, row, tokens, k):
        at = len(tokens) - len(ids)  # reply tokens so far
        return [(t + 1) % 97 if (at + j) % 3 == 2 else t for j, t in enumerate(want[at:at + k])]

    monkeypatch.setattr(continuous_mtp, "propose", propose)
    try:
        (seq,), _, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))], lookup=None, num_speculative_tokens=3,
                           rows=1)
    finally:
        model.close()
    assert seq.generated == want
    assert 0 < seq.accepted_tokens < seq.draft_tokens


def test_a_compiled_decode_step_rolls_back_with_a_second_pass(path, monkeypatch):
    """A decode step that is not the eager decoder (a compiled one) records no DeltaNet input: the rollback reruns
    the kept tokens as a whole pass instead; the tokens are plain greedy's all the same."""
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = prompt(3)
    want = greedy(model, ids)
    decoder = model.runner.decoder
    monkeypatch.setattr(model.runner, "decode_fn", lambda *a, **kw: decoder(*a, **kw))
    try:
        (seq,), _, engine = run(model, [(ids, SamplingParams(max_new_tokens=NEW))], lookup=None,
                                num_speculative_tokens=3, rows=1)
    finally:
        model.close()
    assert engine.mtp.recorder is None
    assert seq.generated == want and seq.draft_tokens > seq.accepted_tokens
