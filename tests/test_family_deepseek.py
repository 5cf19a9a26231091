"""DeepSeek-V2 / V3 and GLM-4.5 through ``moeflow.MoEModel`` against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE, make_checkpoint

from moeflow import MoEModel

pytest.importorskip("transformers")
CASES = [("deepseek_v3", n) for n in DEEPSEEK_V3] + [("deepseek_v2", n) for n in DEEPSEEK_V2] + \
    [("glm4_moe", n) for n in GLM4_MOE]
CONFIGS = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "glm4_moe": GLM4_MOE}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind,name", CASES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind, name):
    _, ref = make_checkpoint(tmp_path, kind, seed=1, **CONFIGS[kind][name])
    model = MoEModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert model.family.name == kind
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    got = model(ids).logits
    assert rel_err(got, want) < 1e-4
    with torch.no_grad():
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got_tokens = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=[])
    assert torch.equal(got_tokens, want_tokens)
