"""The speculative sampling rule (moeflow.engine.spec_sampling) samples the target distribution p whatever the draft
distribution q: 6000 seeded draws (a draft from q, then the rule) land within 4 standard errors of p, and the drafts
are kept at the rule's rate sum_x min(p, q). ~4 s."""

from __future__ import annotations

import pytest
import torch

from moeflow.engine.sampling import GenerationConfig
from moeflow.engine.spec_sampling import accept_or_resample, sampler_probs

P = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
QS = [torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1]), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]), P.clone()]


@pytest.mark.parametrize("q", QS)
def test_output_law_is_p(q):
    g = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(5)
    kept = 0
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g)[0])
        ok, tok = accept_or_resample(P, q, x, g)
        kept += ok
        counts[tok] += 1
    freq = counts / n
    se = (P * (1 - P) / n).sqrt()
    assert bool(((freq - P).abs() <= 4 * se + 1e-9).all()), (freq, P)
    accept = float(torch.minimum(P, q).sum())  # the rule's acceptance rate: sum_x min(p, q)
    assert abs(kept / n - accept) <= 4 * (accept * (1 - accept) / n) ** 0.5 + 1e-9


def test_sampler_probs_apply_penalty_and_filters():
    gen = GenerationConfig(do_sample=True, temperature=0.5, top_k=2, repetition_penalty=2.0)
    logits = torch.tensor([[2.0, 1.8, 0.9, -1.0]])
    probs = sampler_probs(logits, gen, torch.tensor([0]))
    # token 0's logit halved by the penalty (2.0 -> 1.0): the top two are tokens 1 and 0, token 1 the likelier
    assert probs.shape == (4,) and float(probs.sum()) == pytest.approx(1.0)
    assert torch.equal(probs > 0, torch.tensor([True, True, False, False])) and float(probs[1]) > 0.5
