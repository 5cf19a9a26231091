"""The predictor presets on the embedded tiny model with the predictors shipped next to it
(``moeflow/data/tiny-mixtral-awq/predictors/``, built by scripts/build_embedded_predictors.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.offload.predictors import ModelShape, load_predictor

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
PREDICTORS = MODEL / "predictors"
NEW_TOKENS = 10


def test_predictors_are_shipped_for_the_current_model():
    # the package ships them; a missing file is a packaging bug, not a reason to skip
    for kind in ("duoserve", "promoe", "finemoe", "expertflow"):
        assert (PREDICTORS / f"{kind}.pt").is_file(), kind
    # built for these exact weights (rebuilding the model without its predictors leaves stale ones)
    built_for = json.loads((PREDICTORS / "README.json").read_text())["model_sha"]
    assert hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest().startswith(built_for)


@pytest.fixture(scope="module")
def reference():
    # the all-resident model on the CPU int4 path (int8 lm_head, experts in torch's int4 form): the offloaded runs
    # (kernels "auto" on the CPU) compute their slots with the same int4 kernels on the same bytes
    model = MoEOffloadedMixtral.from_pretrained(MODEL)
    assert model.kernels == "cpu-int4" and type(model.model.lm_head).__name__ == "CpuQuantLinear"
    assert type(model.experts).__name__ == "CpuInt4Experts"
    ids = torch.tensor([model.tokenizer.encode("The \"with\" statement is used to wrap the execution")])
    yield model, ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_shipped_predictors_fit_the_model_and_are_small(reference):
    model, *_ = reference
    shape = ModelShape.from_config(model.config)
    for kind in ("duoserve", "promoe", "finemoe"):
        path = PREDICTORS / f"{kind}.pt"
        assert path.stat().st_size < 400 * 1024, f"{path} is {path.stat().st_size} bytes"
        assert load_predictor(path, expect=shape).kind == kind


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", ["duoserve", "promoe", "finemoe", "auto"])
def test_greedy_tokens_equal_resident(reference, policy, transport):
    model, ids, expected = reference
    total = model.config.num_hidden_layers * model.config.num_local_experts
    for n_slots in (2, 3, 4, 6, 8, 12, 16, 24, total):  # the minimum to every expert
        m = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots))
        try:
            out = m.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            m.experts.close()
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots"
        if policy != "auto" and 4 <= n_slots < total:
            assert m.stats.decode.prefetches > 0
