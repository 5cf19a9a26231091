"""The exact-token invariant for the paper-or-variant switches (``OffloadConfig.policy_options``): each policy run
with every switch the paper's way and every switch moeflow's way, at every slot count from top-k to all experts,
with the synchronous and the random-delay transport, generates exactly the greedy tokens of "resident".

The tiny checkpoint and its trained predictors are tests/test_policies.py's (fixture ``tiny``); ~20 s here."""

from __future__ import annotations

import pytest
import torch
from test_policies import EXPERTS, LAYERS, TOP_K, _generate, tiny  # noqa: F401 (tiny: the module's fixture)

PAPER = {"refresh_on_prefetch": True, "prefetch_chunks": "per-linear", "queue_priority": True,
         "prefill_iteration": "pass", "predict_in_prefill": False}
VARIANT = {"refresh_on_prefetch": False, "prefetch_chunks": "pieces", "queue_priority": False,
           "prefill_iteration": "token", "predict_in_prefill": True}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("options", [PAPER, VARIANT], ids=["paper", "variant"])
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", ["promoe", "finemoe", "duoserve", "mixtral-offloading"])
def test_switches_keep_the_tokens(tiny, policy, transport, options):  # noqa: F811 (the fixture)
    path, _, ids, mask, expected = tiny
    prefetched = 0
    for n_slots in range(TOP_K, LAYERS * EXPERTS + 1):
        out, model = _generate(path, ids, mask, policy=policy, gpu_expert_slots=n_slots, transport=transport,
                               random_delay_ms=0.3, seed=n_slots, policy_options=options)
        assert torch.equal(out, expected), f"{policy}/{transport}/{options} with {n_slots} slots: {out} != {expected}"
        assert model.experts.mechanisms.prefetch_chunks == options["prefetch_chunks"]
        s = model.stats
        prefetched += s.decode.prefetches
        if not options["predict_in_prefill"]:  # no predictor (nor FineMoE's embedding hook) in prefill
            assert s.prefill.prefetches == 0, f"{policy} predicted in prefill with predict_in_prefill=False"
    assert prefetched > 0, f"{policy} never prefetched in decode"


@pytest.mark.parametrize("h2d_gbps", [None, 1e-6], ids=["measured-link", "slow-link"])
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", ["promoe", "finemoe", "duoserve", "mixtral-offloading"])
def test_prefetch_gate_keeps_the_tokens(tiny, policy, transport, h2d_gbps):  # noqa: F811 (the fixture)
    """The bandwidth-aware prefetch gate (beyond the papers) on every predictive policy: it only drops guesses, so
    the tokens stay resident's; on a configured 1 kB/s link no guess after the first measured layer period pays.
    expertflow (whose predictor the tiny fixture lacks): tests/test_prefetch_gate.py on the embedded model."""
    path, _, ids, mask, expected = tiny
    seen = gated = 0
    for n_slots in range(TOP_K, LAYERS * EXPERTS + 1):
        out, model = _generate(path, ids, mask, policy=policy, gpu_expert_slots=n_slots, transport=transport,
                               random_delay_ms=0.3, seed=n_slots, policy_options={"prefetch_gate": True},
                               h2d_gbps=h2d_gbps)
        assert torch.equal(out, expected), f"{policy}/{transport}/gate with {n_slots} slots: {out} != {expected}"
        assert model.experts.loads.gate is not None
        s = model.stats
        seen += s.prefill.prefetches + s.decode.prefetches + s.prefill.gated_prefetches + s.decode.gated_prefetches
        gated += s.prefill.gated_prefetches + s.decode.gated_prefetches
    assert seen > 0, f"{policy} never guessed an expert that was not cached"
    if h2d_gbps is not None:
        assert gated > 0, f"{policy}: the gate admitted every guess over a 1 kB/s link"
