"""Pinned behaviour of the bandwidth-aware prefetch gate (``policy_options={"prefetch_gate": True}``; beyond the
papers, issue 41): its accuracy per rank, its fetch fraction from the link's backlog and the layer period, and the
guesses it turns away in a backend, both ways. Like tests/test_policy_counts.py: a hand-set clock and link rate,
the synchronous transport, every expected number derived in the comment beside it. ~1 s."""

from __future__ import annotations

import pytest
import torch
from test_expertflow_embedded import MODEL
from test_policy_counts import backend_for, step
from test_scheduling_helpers import DENSE, Synthetic

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.offload.policies.spec import Mechanisms
from moeflow.offload.prefetch_gate import PrefetchGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gate_arithmetic():
    clock = Clock()
    # 100-byte experts over a 100 B/s link: one copy takes 1 s; 4 layers
    gate = PrefetchGate(100, 4, clock, lambda: 100.0)
    # nothing known: a = 0.5 (the (1, 1) prior), b = 0, fetch fraction 1 -> 0.5 * 1 + 0 >= 1 - 0.5: admitted
    assert gate.accuracy(0, "decode") == (0.5, 0.0)
    assert gate.fetch_fraction(2, 1, 10_000, "decode") == 1.0
    assert gate.admit(2, 0, 1, 0, "decode")
    gate.record(1, [5, 6, 7], "decode")  # ranks 0, 1, 2 for layer 1
    gate.layer_gate(0, [0], "decode")  # t = 0
    clock.now = 2.0
    gate.layer_gate(1, [5], "decode")  # period 2 s; rank 0 needed at once; ranks 1 and 2 wait (1 gate seen)
    assert gate.period_s == {"prefill": None, "decode": 2.0}
    assert gate.accuracy(0, "decode") == pytest.approx((2 / 3, 0.0))
    gate.layer_gate(1, [7], "decode")  # the next pass: rank 2 needed later (b); not consecutive: no period sample
    gate.layer_gate(1, [], "decode")
    gate.layer_gate(1, [], "decode")  # rank 1 unused for HORIZON = 4 gates: counted as never needed
    assert gate.period_s["decode"] == 2.0
    assert gate.accuracy(1, "decode") == pytest.approx((1 / 3, 0.0))
    assert gate.accuracy(2, "decode") == pytest.approx((1 / 3, 1 / 3))
    # layer 2 from layer 1: 1 layer x 2 s of slack = 2 copies: f = 1 behind 100 bytes, 0.4 behind 160
    assert gate.fetch_fraction(2, 1, 100, "decode") == 1.0
    assert gate.fetch_fraction(2, 1, 160, "decode") == pytest.approx(0.4)
    assert gate.fetch_fraction(0, 3, 0, "decode") == 1.0  # wraps: layer 0 of the next pass is one layer away
    assert gate.fetch_fraction(2, 1, 300, "decode") == 0.0  # the backlog outlasts the slack
    # rank 0 (2/3, 0): 2/3 * 1 >= 1/3, 2/3 * 0.4 < 1/3; rank 1 (1/3, 0): 1/3 < 2/3 even on an idle link;
    # rank 2 (1/3, 1/3): its later uses pay where the copy lands late: 1/3 * 0.4 + 1/3 >= 1/3
    assert gate.admit(2, 0, 1, 100, "decode") and not gate.admit(2, 0, 1, 160, "decode")
    assert not gate.admit(2, 1, 1, 0, "decode")
    assert gate.admit(2, 2, 1, 160, "decode")
    assert gate.admit(2, 1, 1, 0, "prefill")  # phases apart: prefill knows nothing yet


@pytest.mark.parametrize("gated", [False, True])
def test_gate_turns_away_what_does_not_pay(gated):
    """lru with a predictor's guesses handed in by ``backend.prefetch``; one copy takes 1 s, layer period 1 s."""
    synth = Synthetic(DENSE, layers=2, experts=4, top_k=1, seed=2)
    backend, stats = backend_for(synth, policy="lru", gpu_expert_slots=4, h2d_gbps=DENSE.nbytes / 1e9,
                                 policy_options={"prefetch_gate": gated})
    assert backend.mechanisms.prefetch_gate is gated
    clock = Clock()
    if gated:
        backend.loads.gate.clock = clock
    else:
        assert backend.loads.gate is None
    stats.set_phase("decode")
    step(backend, stats, 0, [0])  # t = 0, a hit (warm start: (0,0), (1,0), (0,1), (1,1))
    # ranks 0 and 1 for layer 1, neither cached; no period yet, prior 0.5: both admitted either way
    backend.prefetch(1, [2, 3], layer_now=0)
    assert (stats.decode.prefetches, stats.decode.gated_prefetches) == (2, 0)
    clock.now = 1.0
    step(backend, stats, 1, [2])  # a hit on the rank-0 guess (a = 2/3); rank 1 not needed yet (prior a = 1/2); 1 s
    # for layer 0 (next pass, one layer away: 1 s = one copy): rank 0 (2/3 x f = 1) admitted, its copy fills the
    # slack; rank 1 (1/2 x f = 0 < 1/2) turned away; without the gate both move
    backend.prefetch(0, [2, 3], layer_now=1)
    assert (stats.decode.prefetches, stats.decode.gated_prefetches) == ((3, 1) if gated else (4, 0))
    assert stats.decode.hits == 2
    backend.close()


def test_gate_option_is_checked():
    with pytest.raises(SchedulingError, match="prefetch_gate"):
        Mechanisms().with_options({"prefetch_gate": "yes"})


def test_expertflow_gate_keeps_the_tokens():
    """The exact-token invariant of the gate under expertflow (the embedded model and its shipped predictor; the
    other predictive policies: tests/test_paper_invariant.py), batched with micro-batches, measured and slow link."""
    ref = MoEOffloadedMixtral.from_pretrained(MODEL)
    enc = [ref.tokenizer.encode(t) for t in ("Return the", "class Foo:\n    def")]
    width = max(map(len, enc))
    ids, mask = torch.zeros((2, width), dtype=torch.long), torch.zeros((2, width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    expected = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    gated = 0
    for slots, transport, gbps in ((8, "sync", None), (16, "random-delay", None), (8, "sync", 1e-6)):
        m = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=slots, transport=transport, random_delay_ms=0.3, h2d_gbps=gbps,
            policy_options={"prefetch_gate": True}))
        try:
            out = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, micro_batch_size=1)
        finally:
            m.experts.close()
        assert torch.equal(out, expected), (slots, transport, gbps)
        if gbps is not None:
            gated += m.stats.decode.gated_prefetches + m.stats.prefill.gated_prefetches
    assert gated > 0  # over a 1 kB/s link some guess was turned away
