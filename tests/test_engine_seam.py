"""The engine -> backend seam (begin_step once per pass with the embeddings, predict_paths for micro-batches,
finish_loading, close), MoEModel's family choice, and the routing functions behind RouterSpec."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import CheckpointError, MoEModel, MoEOffloadedMixtral
from moeflow.families import MixtralFamily, supported_model_types
from moeflow.moe import ExpertBackend, RouterSpec, StepInfo, make_router, route, softmax_topk

LAYERS, EXPERTS = 2, 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("seam"), seed=5)


class Recording(ExpertBackend):
    """Forwards to a real backend and records what the engine tells it."""

    def __init__(self, inner: ExpertBackend, paths: torch.Tensor | None = None) -> None:
        self.inner, self.fmt, self.paths = inner, inner.fmt, paths
        self.events: list[tuple] = []

    def load_expert(self, layer, expert, tensors):
        self.inner.load_expert(layer, expert, tensors)

    def begin_step(self, step: StepInfo) -> None:
        self.events.append(("begin", step))

    def predict_paths(self, step: StepInfo, last_only: bool = False):
        self.events.append(("predict", step, last_only))
        return self.paths

    def forward(self, layer, x, probs, topk_ids, topk_weights):
        self.events.append(("forward", layer, x.shape[0]))
        return self.inner.forward(layer, x, probs, topk_ids, topk_weights)

    def close(self) -> None:
        self.events.append(("close",))


def test_begin_step_precedes_layer_zero_of_every_pass_with_the_embeddings(ckpt):
    model = MoEModel.from_pretrained(ckpt)
    rec = Recording(model.experts)
    model.use_backend(rec)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model.generate(ids, max_new_tokens=3, eos_token_id=[])
    kinds = [e[0] for e in rec.events]
    # prefill + 2 decode passes (the last token is never fed back), each: begin, then one forward per MoE layer
    assert kinds == ["begin", "forward", "forward"] * 3
    begins = [e[1] for e in rec.events if e[0] == "begin"]
    assert [s.phase for s in begins] == ["prefill", "decode", "decode"]
    assert torch.equal(begins[0].input_ids, ids) and begins[0].rows is None
    assert torch.equal(begins[0].embeds, model.model.embed_tokens(ids))
    assert torch.equal(begins[1].input_ids, out[:, 3:4]) and tuple(begins[1].embeds.shape) == (2, 1, 64)
    assert torch.equal(begins[2].history_ids, out[:, :5]) and bool(begins[2].history_mask.all())
    assert [e[1] for e in rec.events if e[0] == "forward"] == [0, 1] * 3
    model.close()
    assert rec.events[-1] == ("close",)
    del model
    gc.collect()
    assert [e for e in rec.events if e[0] == "close"] == [("close",)]  # closed once, not again on deletion
    other = MoEModel.from_pretrained(ckpt)
    rec2 = Recording(other.experts)
    other.use_backend(rec2)
    del other
    gc.collect()
    assert rec2.events == [("close",)]  # deleting the model closes its backend


def test_micro_batches_ask_the_backend_and_follow_its_paths(ckpt):
    ref = MoEModel.from_pretrained(ckpt)
    ids = torch.randint(3, 97, (4, 5), generator=torch.Generator().manual_seed(0))
    expected = ref.generate(ids, max_new_tokens=4, eos_token_id=[])
    paths = torch.zeros(4, LAYERS, EXPERTS, dtype=torch.bool)
    paths[::2, :, 0] = paths[1::2, :, 5] = True  # sequences 0 and 2 share a path, 1 and 3 another
    model = MoEModel.from_pretrained(ckpt)
    rec = Recording(model.experts, paths)
    model.use_backend(rec)
    out = model.generate(ids, max_new_tokens=4, eos_token_id=[], micro_batch_size=2)
    assert torch.equal(out, expected)
    asks = [e for e in rec.events if e[0] == "predict"]
    assert [(tuple(e[1].history_ids.shape), e[2]) for e in asks] == [((4, 5), False), ((4, 6), True),
                                                                     ((4, 7), True), ((4, 8), True)]
    rows = [e[1].rows.tolist() for e in rec.events if e[0] == "begin"]
    assert rows == [[0, 2], [1, 3]] * 4  # every pass grouped by the predicted paths
    # without predictions the engine groups by the paths it recorded: still the full batch's tokens
    rec.paths = None
    assert torch.equal(model.generate(ids, max_new_tokens=4, eos_token_id=[], micro_batch_size=3), expected)


def test_moe_model_picks_the_family_and_names_the_supported_ones(ckpt, tmp_path):
    model = MoEModel.from_pretrained(ckpt)
    assert isinstance(model.family, MixtralFamily) and model.family.moe_layers == (0, 1)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(model.generate(ids, max_new_tokens=5),
                       MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, max_new_tokens=5))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((ckpt / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen9_moe"}))
    with pytest.raises(CheckpointError, match=r"qwen9_moe.*supported model types: .*gpt_oss.*mixtral"):
        MoEModel.from_pretrained(bad)
    assert {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe",
            "glm4_moe_lite", "dots1", "ernie4_5_moe", "minimax_m2", "hunyuan_v1_moe",
            "gpt_oss"} <= set(supported_model_types())


def test_routing_functions():
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    probs, ids, weights = route(logits, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    assert torch.equal(ids.long(), probs.topk(2, dim=-1).indices)
    _, ids2, raw = softmax_topk(logits, 2, renormalize=False)
    assert torch.equal(ids2, ids) and torch.allclose(raw, probs.gather(1, ids.long()))
    scaled = make_router(RouterSpec(top_k=2, scaling_factor=2.5))(logits)[2]
    assert torch.allclose(scaled, 2.5 * weights)
    with pytest.raises(NotImplementedError, match="topk_before_scoring"):
        make_router(RouterSpec(top_k=2, scoring="sigmoid", topk_before_scoring=True))
