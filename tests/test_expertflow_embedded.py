"""Policy "expertflow" on the embedded tiny model with its shipped predictor (scripts/build_expertflow_predictor.py)."""

from __future__ import annotations

from pathlib import Path

import torch

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.offload.predictors import ModelShape, load_predictor

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
PREDICTOR = MODEL / "predictors" / "expertflow.pt"


def test_shipped_predictor_fits_and_batched_tokens_equal_resident():
    ref = MoEOffloadedMixtral.from_pretrained(MODEL)  # resident CPU int4: the offloaded runs' kernels and bytes
    assert PREDICTOR.stat().st_size < 500 * 1024
    pred = load_predictor(PREDICTOR, expect=ModelShape.from_config(ref.config))
    assert pred.kind == "expertflow"
    texts = ["The \"with\" statement is used", "Return the", "class Foo:\n    def"]
    enc = [ref.tokenizer.encode(t) for t in texts]
    width = max(map(len, enc))
    ids = torch.zeros((len(enc), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    expected = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for slots, transport in ((2, "random-delay"), (8, "sync"), (16, "random-delay")):
        m = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=slots, transport=transport, random_delay_ms=0.3))
        try:
            out = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, micro_batch_size=2)
            # the micro-batches are grouped by the backend's predict_paths (the expertflow policy's predictor)
        finally:
            m.experts.close()
        assert torch.equal(out, expected), (slots, transport)
        if slots >= 8:
            assert m.stats.decode.useful_prefetches > 0
