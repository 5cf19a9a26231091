"""ExpertFlow's token scheduler in prefill (``Mechanisms.prefill_regroup``, moeflow/offload/token_groups.py and the
expertflow predictor's ``token_groups``): pinned counts of a layer computed in token micro-batches, the predictor's
grouping of a prefill's tokens across prompts, and the exact-token invariant. ~10 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint
from test_expertflow import padded_batch  # n left-padded prompts of random lengths
from test_policy_counts import backend_for, resident
from test_scheduling_helpers import DENSE, Synthetic
from tiny_families import expertflow_predictor_file

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.offload.policies.expertflow.scheduler import activated_pairs, balanced_split, group_by_routing
from moeflow.offload.predictors.interface import Predictor, Proposals

LAYERS, EXPERTS = 3, 8


class FixedGroups(Predictor):
    """A predictor that proposes nothing and hands the backend fixed token micro-batches (the backend's side of
    ``prefill_regroup`` pinned without a learned predictor)."""

    def __init__(self, groups: list[list[int]] | None) -> None:
        self.groups = groups

    def propose(self, layer: int, x: torch.Tensor) -> Proposals:
        return []

    def token_groups(self) -> list[list[int]] | None:
        return self.groups


def prefill_layer(route: list[list[int]], groups: list[list[int]] | None, experts: int = 6):
    """4 prefill tokens of one layer routed to ``route`` (top-k, equal weights) on 2 slots under LRU, the layer
    computed in ``groups`` (None: one group). Warm start: the slots hold experts 0 (tick 1) and 1 (tick 2).
    -> (hits, misses, resident after); the output is checked against the resident backend's."""
    k = len(route[0])
    synth = Synthetic(DENSE, layers=1, experts=experts, top_k=k, seed=2)
    backend, stats = backend_for(synth, {"predictor": lambda ctx: FixedGroups(groups)}, policy="lru",
                                 gpu_expert_slots=2)
    stats.set_phase("prefill")
    ids = torch.tensor(route, dtype=torch.int32)
    probs = torch.zeros(4, experts).scatter_(1, ids.long(), 1.0 / k)
    x = torch.randn(4, DENSE.hidden_size, generator=torch.Generator().manual_seed(0))
    w = torch.full((4, k), 1.0 / k)
    with torch.no_grad():
        out = backend.forward(0, x, probs, ids, w)
        ref = synth.resident().forward(0, x, probs, ids, w)
    torch.testing.assert_close(out, ref)
    backend.cache.check()
    assert not any(s.in_use for s in backend.cache.slots)
    got = stats.prefill.hits, stats.prefill.misses, resident(backend, 0)
    backend.close()
    return got


FIG4 = [[0, 1], [2, 3], [0, 1], [2, 3]]  # ExpertFlow Fig. 4 in small: two paths, interleaved over the tokens


def test_one_group_loads_each_expert_once():
    # needed [0, 1, 2, 3]: 0 and 1 hit, computed first and released; 2 and 3 loaded into their slots
    assert prefill_layer(FIG4, None) == (2, 2, {2, 3})


def test_token_order_micro_batches_reload():
    # [0, 1] needs 0-3: as one group above -> {2, 3}; [2, 3] needs 0-3 again: 2, 3 hit, 0, 1 loaded again
    assert prefill_layer(FIG4, [[0, 1], [2, 3]]) == (4, 4, {0, 1})


def test_regrouped_micro_batches_need_one_path_each():
    # [0, 2] needs 0, 1 (both hit); [1, 3] needs 2, 3 (both loaded): half the loads of the token order
    assert prefill_layer(FIG4, [[0, 2], [1, 3]]) == (2, 2, {2, 3})


def test_regrouped_micro_batches_can_evict_each_other():
    # top-1, 2 0 2 0; one group: needs 0 (hit, tick 3), 2 (loaded over 1, the oldest)
    assert prefill_layer([[2], [0], [2], [0]], None, experts=4) == (1, 1, {0, 2})
    # regrouped: [0, 2] needs 2 (loaded over 0, the oldest at tick 1), then [1, 3] needs 0 (loaded again, over 1)
    assert prefill_layer([[2], [0], [2], [0]], [[0, 2], [1, 3]], experts=4) == (0, 2, {0, 2})


def test_groups_must_cover_every_token_once():
    with pytest.raises(SchedulingError, match="cover 3 token indices"):
        prefill_layer(FIG4, [[0, 2], [1]])


# ---------------------------------------------------------------------------------------------- the policy
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pr"), seed=5, num_local_experts=EXPERTS,
                                num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def predictor_file(ckpt, tmp_path_factory):
    return expertflow_predictor_file(ckpt, tmp_path_factory.mktemp("prp"))


def expertflow(ckpt, predictor_file, slots: int, regroup: bool, keep_contiguous: bool = True,
               transport: str = "sync", seed: int = 0):
    return MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
        policy="expertflow", gpu_expert_slots=slots, predictor_path=str(predictor_file), transport=transport,
        random_delay_ms=0.3, seed=seed,
        policy_options={"prefill_regroup": regroup, "keep_contiguous": keep_contiguous}))


@pytest.mark.parametrize("keep_contiguous", [True, False])
def test_the_predictor_regroups_a_prefill_across_prompts(ckpt, predictor_file, keep_contiguous):
    """One prefill of 4 prompts: the tokens of all prompts (row by row) into two balanced micro-batches by the
    policy's scheduler on the predicted paths; decode passes and the switch off: none."""
    ids, mask = padded_batch(4, seed=3, lo=4, hi=12)
    model = expertflow(ckpt, predictor_file, 12, True, keep_contiguous)
    pred = model.experts.predictor
    seen: list = []
    begin = pred.begin_step
    pred.begin_step = lambda step: (begin(step), seen.append((step.phase, pred.token_groups())))
    model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[])
    (phase, groups), *decode = seen
    assert phase == "prefill" and all(g is None for _, g in decode) and len(decode) == 2
    # the same grouping from the predictor's own token paths of the prompts, row by row
    scores = torch.cat([pred.predictor.token_scores(ids[i][mask[i].bool()], int(mask[i].sum())).cpu()
                        for i in range(4)])
    paths = pred.predictor.token_paths(scores)
    n = paths.shape[0]
    assert n == int(mask.sum()) and sorted(map(len, groups)) == [n // 2, n - n // 2]
    assert groups == group_by_routing(paths, -(-n // 2), keep_contiguous=keep_contiguous)
    st = pred.state
    assert st.prefill_regroups == 1
    assert st.prefill_pairs == activated_pairs(paths, groups)
    assert st.prefill_contiguous_pairs == activated_pairs(paths, balanced_split(n, -(-n // 2)))
    if keep_contiguous:  # moeflow's variant never activates more than the token order
        assert st.prefill_pairs <= st.prefill_contiguous_pairs
    off = expertflow(ckpt, predictor_file, 12, False)
    off.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[])
    assert off.experts.predictor.state.prefill_regroups == 0


def test_exact_tokens_every_slot_count(ckpt, predictor_file):
    """Every slot count 2..24, sync and random-delay transports on alternate counts, both scheduler variants, with
    and without the dual-batch pipeline's micro-batches: the tokens are the resident model's."""
    ids, mask = padded_batch(6, seed=1)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=4,
                                                             eos_token_id=[])
    for slots in range(2, LAYERS * EXPERTS + 1):
        transport = "sync" if slots % 2 else "random-delay"
        model = expertflow(ckpt, predictor_file, slots, True, keep_contiguous=slots % 3 != 0, transport=transport,
                           seed=slots)
        micro = (None, 3)[slots % 2]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], micro_batch_size=micro)
        assert torch.equal(out, ref), (slots, transport, micro)
        assert model.experts.predictor.state.prefill_regroups == (1 if micro is None else 2), slots
        model.experts.cache.check()


def test_the_server_keeps_the_tokens(ckpt, predictor_file):
    """The continuous-batching engine's prefill of 4 prompts admitted at once (one pass over every prompt's tokens),
    regrouped: each reply is the resident model's greedy continuation."""
    from moeflow.engine.continuous import ContinuousEngine, SamplingParams
    from moeflow.engine.kv_slots import SlotKVCache

    prompts = [[5 + i, 17, 33 + 2 * i, 40, 9 + i, 61][: 3 + i] for i in range(4)]
    ref = MoEOffloadedMixtral.from_pretrained(ckpt)
    want = [ref.generate(torch.tensor([p]), max_new_tokens=4, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
    for slots in (3, 8, 13):
        model = expertflow(ckpt, predictor_file, slots, True)
        cache = SlotKVCache.for_model(model, 32, max_rows=4)
        eng = ContinuousEngine(model, cache, prefill_chunk=64)
        seqs = [eng.submit(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        eng.start()
        try:
            got = [s.result(120) for s in seqs]
        finally:
            eng.stop()
        assert got == want, slots
        assert model.experts.predictor.state.prefill_regroups >= 1, slots
