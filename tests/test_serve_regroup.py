"""ExpertFlow's token scheduler in the serving engine (``moeflow/engine/continuous_regroup.py``,
``ContinuousEngine(micro_batch_size=, token_scheduler=)``, ``moeflow serve --micro-batch-size``): a decode step's
rows as micro-batches grouped by predicted routing paths, each a pass of its own.

Exact tokens: concurrent requests on the embedded model under expertflow, every scheduler x slot counts x
transports, give each request the all-resident model's greedy tokens; seeded sampling is the one-pass engine's.
Pinned: a hand-made planner whose paths follow each row's position parity (hand-derived groups and pairs), and the
embedded model's loads per scheduler (synchronous copies: a function of the requests). ~25 s on the loaded
2-core machine (9 s of it the captured passes).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import build_parser, embedded_model_path
from moeflow.cli.serve import _describe, _micro_batch_size
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.continuous_regroup import DecodeRegrouper, make_regrouper
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.moe.backend import StepInfo

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = b"The import statement combines two operations; it searches for the named module, then it binds "
# prompts of 5, 8, 7 and 10 tokens: while all four decode, rows 0 and 2 feed odd positions, rows 1 and 3 even ones
PROMPTS = [list(TEXT[i:i + n]) for i, n in ((0, 5), (10, 8), (20, 7), (3, 10))]
BUDGETS = (6, 5, 7, 4)
TIMEOUT_S = 120


def expertflow(slots: int, transport: str = "sync") -> MoEOffloadedMixtral:
    return MoEOffloadedMixtral.from_pretrained(
        embedded_model_path(), offload=OffloadConfig(policy="expertflow", gpu_expert_slots=slots, transport=transport,
                                                     random_delay_ms=0.3, seed=slots))


def serve(model, budgets=BUDGETS, params: dict | None = None, regroup: DecodeRegrouper | None = None,
          **engine) -> tuple[list[list[int]], ContinuousEngine]:
    """Every prompt submitted before the engine starts (all admitted at once, one prefill pass) -> replies."""
    cache = SlotKVCache.for_model(model, 64, max_rows=4)
    eng = ContinuousEngine(model, cache, prefill_chunk=64, **engine)
    if regroup is not None:
        eng.regroup = regroup
    seqs = [eng.submit(p, SamplingParams(max_new_tokens=n, **(params or {}))) for p, n in zip(PROMPTS, budgets,
                                                                                              strict=True)]
    eng.start()
    try:
        got = [s.result(TIMEOUT_S) for s in seqs]
    finally:
        eng.stop()
    assert cache.free_rows == 4
    return got, eng


@pytest.fixture(scope="module")
def resident_replies():
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), offload=OffloadConfig(policy="resident"))
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
            for p, n in zip(PROMPTS, BUDGETS, strict=True)]


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("scheduler,size", [("policy", "auto"), ("clustering", "auto"), ("contiguous", "auto"),
                                            ("clustering-or-contiguous", 1)])
def test_split_steps_give_resident_tokens(resident_replies, scheduler, size, transport):
    for slots in (4, 12, 24):
        model = expertflow(slots, transport)
        got, eng = serve(model, micro_batch_size=size, token_scheduler=scheduler)
        model.experts.close()
        assert got == resident_replies, f"{scheduler}/{size}/{transport} at {slots} slots"
        st = eng.regroup.stats
        assert st.steps >= 3 and st.micro_batches >= 2 * st.steps  # the steps really ran split


def test_seeded_sampling_is_the_one_pass_engines():
    params = {"do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 3}
    model = expertflow(12)
    one, _ = serve(model, params=params)
    split, eng = serve(model, params=params, micro_batch_size="auto")
    model.experts.close()
    assert split == one and eng.regroup.stats.steps >= 3


def test_captured_split_passes_give_resident_tokens(resident_replies):
    """The micro-batches' passes through the captured decode steps (TraceCapture, the CPU stand-in of CUDA graphs:
    padded to 1 / 2 rows) give the eager split engine's tokens and the resident model's."""
    from test_serve_graphs import captured

    model, graphs = captured(OffloadConfig(policy="expertflow", gpu_expert_slots=12))
    try:
        got, eng = serve(model, micro_batch_size="auto", token_scheduler="clustering")
    finally:
        model.close()
    assert eng.graphs is graphs and graphs.refused is None and graphs.captures > 0
    assert got == resident_replies and eng.regroup.stats.steps >= 3


class ParityPlanner:
    """Paths by the parity of the position each row feeds: experts {0, 1} of every layer at an even position,
    {2, 3} at an odd one (a stand-in for the policy's planner)."""

    def __init__(self, layers: int, experts: int) -> None:
        self.layers, self.experts = layers, experts
        self.state = None

    def step_scores(self, step: StepInfo) -> torch.Tensor:
        odd = (step.positions[:, 0] % 2).tolist()
        scores = torch.zeros((len(odd), self.layers, self.experts))
        for b, o in enumerate(odd):
            scores[b, :, 2 * o:2 * o + 2] = 1.0
        return scores

    def paths_from_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores > 0

    def plan_from_scores(self, scores: torch.Tensor) -> dict[int, list[int]]:
        raise AssertionError("the engine hands the scores to the policy's own planner, not this one")

    def group(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        raise AssertionError("scheduler 'clustering' does not ask the policy")


@pytest.mark.parametrize("scheduler,groups,pairs", [
    # rows 0 and 2 feed odd positions, 1 and 3 even ones: the clustering pairs them, 2 layers' worth of
    # (layer, expert) pairs per micro-batch (4 layers x 2 experts = 8, 16 a step); row order mixes them (4 x 4 each)
    ("clustering", [[0, 2], [1, 3]], 16),
    ("contiguous", [[0, 1], [2, 3]], 32),
])
def test_micro_batch_passes_hold_the_scheduled_rows(resident_replies, scheduler, groups, pairs):
    model = expertflow(12)
    passes: list[list[int]] = []
    begin = model.experts.begin_step

    def record(step: StepInfo) -> None:
        if step.phase == "decode":
            passes.append(step.rows.tolist())
        begin(step)

    model.experts.begin_step = record
    planner = ParityPlanner(model.experts.num_layers, model.experts.num_experts)
    budgets = (4, 4, 4, 4)  # all four decode together: 3 decode steps of 4 rows
    got, eng = serve(model, budgets=budgets, regroup=DecodeRegrouper(planner, "auto", scheduler))
    model.experts.close()
    assert got == [r[:4] for r in resident_replies]
    assert passes == groups * 3
    st = eng.regroup.stats
    assert (st.steps, st.micro_batches, st.pairs, st.contiguous_pairs) == (3, 6, 3 * pairs, 3 * 32)


def test_pinned_loads_per_scheduler():
    """The embedded model, expertflow, 12 of 32 experts in slots, synchronous copies; 4 requests, 18 decode
    tokens: (decode passes, hits, misses (loads), prefetches), and the scheduler's predicted pairs."""
    got = {}
    for size, scheduler in ((None, "policy"), ("auto", "policy"), ("auto", "clustering"), ("auto", "contiguous")):
        model = expertflow(12)
        _, eng = serve(model, micro_batch_size=size, token_scheduler=scheduler)
        d = model.stats.decode
        model.experts.close()
        st = eng.regroup.stats if eng.regroup is not None else None
        got[size, scheduler] = (d.steps, d.tokens, d.hits, d.misses, d.prefetches,
                                None if st is None else (st.micro_batches, st.pairs, st.contiguous_pairs))
    assert got == {
        (None, "policy"): (6, 18, 76, 21, 77, None),
        # moeflow's variant: fewer predicted pairs than the contiguous split (106 < 111); the paper's clustering as
        # it comes activates more here (118) and still loads fewer experts (21 against 22)
        ("auto", "policy"): (11, 18, 97, 23, 73, (10, 106, 111)),
        ("auto", "clustering"): (11, 18, 108, 21, 81, (10, 118, 111)),
        ("auto", "contiguous"): (11, 18, 100, 22, 80, (10, 111, 111)),
    }


def test_switches_and_errors():
    lru = MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                              offload=OffloadConfig(policy="lru", gpu_expert_slots=12))
    assert make_regrouper(lru.experts, "auto") is None  # auto: only where the policy predicts paths
    with pytest.raises(ValueError, match="predicts none"):
        make_regrouper(lru.experts, 2)
    model = expertflow(12)
    engine = ContinuousEngine(model, SlotKVCache.for_model(model, 64, max_rows=2))
    assert engine.regroup is None and engine.history is not None  # off by default; PLEC reads the history anyway
    assert make_regrouper(model.experts, None) is None
    assert make_regrouper(model.experts, "auto").size_for(5) == 3
    assert _describe(None) == "off" and _describe(make_regrouper(model.experts, "auto")) == "policy, 2 micro-batches"
    assert _describe(make_regrouper(model.experts, 3, "contiguous")) == "contiguous, micro-batches of 3"  # the banner
    with pytest.raises(ValueError, match="token scheduler 'k-means'"):
        make_regrouper(model.experts, 2, "k-means")
    with pytest.raises(ValueError, match="micro_batch_size"):
        make_regrouper(model.experts, 0)
    assert [_micro_batch_size(t) for t in ("auto", "off", "3")] == ["auto", None, 3]
    with pytest.raises(argparse.ArgumentTypeError, match="integer >= 1"):
        _micro_batch_size("0")
    args = build_parser().parse_args(["serve", "--micro-batch-size", "3", "--token-scheduler", "clustering"])
    assert (args.micro_batch_size, args.token_scheduler) == (3, "clustering")
    args = build_parser().parse_args(["serve"])
    assert (args.micro_batch_size, args.token_scheduler) == (None, "policy")  # off by default
    model.experts.close()
    lru.experts.close()
