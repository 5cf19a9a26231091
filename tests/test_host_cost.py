"""Issue 14: the host loop's fast paths compute exactly what the plain implementations they replace compute.

Each fast path (the eager combine, the predictors' MLPs run as direct torch calls, FineMoE's searches and
selection on host arrays, PLEC's vectorised victim) is checked against its reference on random inputs, ties
included. That the eager decode makes no ``torch.library`` custom-op call is in test_host_loop.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from moeflow.kernels.experts.reference import combine_reference
from moeflow.offload.combine import combine_in_order
from moeflow.offload.copy_engine import CopyEngine, LoadTask, chunk_ranges
from moeflow.offload.eviction import LRU, Static
from moeflow.offload.policies.duoserve.predictor import expert_mlp
from moeflow.offload.policies.expertflow import PLECEviction, PLECPredictor, PLECState
from moeflow.offload.policies.expertflow.predictor import ExpertFlowPredictor, PathEncoder
from moeflow.offload.policies.finemoe.predictor import FineMoEPredictor, select_experts, similarity_threshold
from moeflow.offload.policies.finemoe.store import ExpertMapStore, TrajectorySearch, _cosine, ranked_selection
from moeflow.offload.predictors.base import ModelShape
from moeflow.offload.predictors.eval_mlp import EvalEncoder, EvalSequential


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_combine_in_order_is_bitwise_the_reference(dtype, k):
    y = torch.randn(5 * k, 33, generator=torch.Generator().manual_seed(k)).to(dtype)
    y[0, :4] = torch.tensor([-0.0, 0.0, float("inf"), -1e-30])
    got = combine_in_order(y, k)
    ref = combine_reference(y, k)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       ref.view(torch.int16 if dtype != torch.float32 else torch.int32))  # bit patterns
    assert got.data_ptr() != y.data_ptr()


def test_eval_sequential_is_bitwise_the_module():
    torch.manual_seed(0)
    mlp = expert_mlp(40, 8, (32, 16, 8))
    for m in mlp:
        if isinstance(m, nn.BatchNorm1d):  # trained statistics, not the identity
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    mlp.eval()
    fast = EvalSequential(mlp)
    for rows in (1, 3):
        x = torch.randn(rows, 40)
        with torch.no_grad():
            ref = mlp(x)
        assert torch.equal(fast(x), ref)
    mlp.train()  # training mode: the module itself (BatchNorm uses batch statistics)
    assert fast(torch.randn(4, 40)).requires_grad


def test_eval_encoder_is_bitwise_the_path_encoder():
    """ExpertFlow's encoder as direct fused-layer calls: the module's own output for decode windows and padded
    prompt windows; the module itself in training mode, with grad on, or with a hook attached."""
    torch.manual_seed(0)
    net = PathEncoder(50, 5, 8, d_model=32, n_heads=4, n_blocks=2, d_ff=64, window=16).eval()
    fast = EvalEncoder(net)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows, width in ((1, 16), (1, 3), (3, 16), (4, 9)):
            ids = torch.randint(0, 50, (rows, width), generator=g)
            pad = torch.zeros(rows, width, dtype=torch.bool)
            pad[1:, width // 2 + 1:] = True  # shorter windows, right-padded as ExpertFlowPredictor._run pads
            assert torch.equal(fast(ids, pad), net(ids, pad))
            if rows == 1:  # no padding given: the cached all-zero mask
                assert torch.equal(fast(ids, None), net(ids, torch.zeros_like(pad)))
        assert fast._plan is not False  # the direct path ran
    ids, pad = torch.randint(0, 50, (1, 8), generator=g), torch.zeros(1, 8, dtype=torch.bool)
    assert fast(ids, pad).requires_grad  # grad on: the module (autograd through it)
    net.heads[0].register_forward_hook(lambda *args: None)
    fast.reset()
    with torch.inference_mode():
        assert torch.equal(fast(ids, pad), net(ids, pad)) and fast._plan is False


@pytest.mark.parametrize("E", [8, 40])  # 40: torch's unstable argsort no longer breaks ties by index
def test_plec_plan_of_one_token_is_the_general_plan(E):
    """A decode step's plan (one token) built with the host mask is the general plan (paths, masses summed
    over tokens, argsort): the same experts in the same order, ties and zero scores included."""
    L, k = 5, 3
    pred = ExpertFlowPredictor(ModelShape(L, E, k), vocab_size=10, d_model=8, n_heads=2, n_blocks=1, d_ff=8,
                               window=4)
    plec = PLECPredictor(pred, PLECState(L, E))
    g = torch.Generator().manual_seed(E)
    for trial in range(200):
        scores = torch.rand(1, L, E, generator=g)
        if trial % 2:
            scores = (scores * 4).round() / 4  # ties, zeros
        paths = pred.token_paths(scores)
        active, mass = paths.any(0).tolist(), (scores * paths).sum(0)
        order = torch.argsort(mass, dim=1, descending=True).tolist()
        ref = {layer: [e for e in order[layer] if active[layer][e]] for layer in range(L)}
        assert plec.plan_from_scores(scores) == ref
        state = PLECState(L, E)
        state.new_pass(ref)
        assert state.planned_mask.sum() == sum(map(len, ref.values()))
        assert all(state.planned_mask[layer, e] and state.planned_rank[layer, e] == r
                   for layer, es in ref.items() for r, e in enumerate(es))


def test_ranked_selection_is_select_experts_then_the_priority_order():
    rng = np.random.default_rng(0)
    for trial in range(400):
        E = int(rng.integers(2, 20))
        k = int(rng.integers(1, E + 1))
        rows = 1 + trial % 2
        p = rng.random((rows, E)).astype(np.float32)
        if trial % 3 == 0:
            p = np.round(p, 1)  # ties
        p /= p.sum(1, keepdims=True)
        score = rng.random(rows).astype(np.float32)
        d = int(rng.integers(1, 4))
        pt = torch.from_numpy(p)
        mask = select_experts(pt, similarity_threshold(torch.from_numpy(score)), k)
        prio = torch.where(mask, pt / d, torch.zeros_like(pt)).sum(0)
        chosen = mask.any(0).tolist()
        ref = [e for e in torch.argsort(prio, descending=True, stable=True).tolist() if chosen[e]]
        assert ranked_selection(p, score, k, d) == ref


def test_ranked_selection_in_python_is_the_numpy_one(monkeypatch):
    """A small row selected in plain Python (float32 rounding emulated) gives numpy's selection and order."""
    from moeflow.offload.policies.finemoe import store as finemoe_store

    rng = np.random.default_rng(5)
    cases = []
    for trial in range(1500):
        E = int(rng.integers(1, 33))
        p = rng.random((1, E)).astype(np.float32) ** rng.choice([1, 4, 12])  # spread: many tiny values
        if trial % 4 == 0:
            p = np.round(p, 1)  # ties and zeros
        if trial % 2:
            p /= max(float(p.sum()), 1e-30)
        score = rng.random(1).astype(np.float32) if trial % 5 else np.ones(1, np.float32)
        k, d = int(rng.integers(1, E + 1)), int(rng.integers(1, 5))
        cases.append((p, score, k, d))
        # scores whose threshold 1 - score - 1e-6 falls within a few float32 steps of a running sum: where
        # summing or subtracting in float64 instead of float32 would take one expert more or less
        ranked = np.sort(p[0])[::-1]
        before = ranked.cumsum() - ranked
        edge = np.float32(1) - (before[int(rng.integers(0, E))] + np.float32(1e-6))
        for step in range(-3, 4):
            s = np.array([edge], np.float32)
            for _ in range(abs(step)):
                s = np.nextafter(s, np.float32(np.sign(step) * np.inf)).astype(np.float32)
            cases.append((p, s, k, d))
    fast = [ranked_selection(*c) for c in cases]
    monkeypatch.setattr(finemoe_store, "_SMALL_E", 0)  # numpy for every row
    assert fast == [ranked_selection(*c) for c in cases]


def test_incremental_trajectory_search_matches_the_cosine_search():
    g = torch.Generator().manual_seed(0)
    L, E, C = 5, 8, 30
    store = ExpertMapStore(L, E, 16, C, distance=2)
    store.add(torch.softmax(torch.randn(C, L, E, generator=g), -1), torch.randn(C, 16, generator=g))
    for rows in (1, 2):
        traj = torch.zeros(rows, L, E)
        search = TrajectorySearch(store)
        for layer in range(L):
            traj[:, layer] = torch.softmax(torch.randn(rows, E, generator=g), -1)
            if layer == 3:  # the store changes mid-iteration: the running sums restart
                store.add(torch.softmax(torch.randn(1, L, E, generator=g), -1), torch.randn(1, 16, generator=g))
            idx, best = search.step(traj, layer)
            ref_best, ref_idx = _cosine(traj[:, : layer + 1].reshape(rows, -1),
                                        store.maps[: store.size, : layer + 1].reshape(store.size, -1)).max(1)
            assert torch.equal(idx, ref_idx)
            assert torch.allclose(best, ref_best, atol=1e-6)
    q = torch.randn(2, 16, generator=g)
    idx, best = store.search_semantic(q)
    ref_best, ref_idx = _cosine(q, store.sems[: store.size]).max(1)
    assert torch.equal(idx, ref_idx) and torch.allclose(best, ref_best, atol=1e-6)


def test_finemoe_runtime_proposals_are_the_full_searches():
    """FineMoE in the runtime (searches kept incremental, only those a later layer reads, the published map's
    semantic redundancy reused from the step's search) proposes, remembers and stores what the plain searches
    give: at layer l, the delta-selection of layer l + d from the map whose layers 0..l-1 best match (the
    semantic search at layer 0), ranked by p / d; each finished iteration replaces the most redundant map."""
    g = torch.Generator().manual_seed(3)
    L, E, H, k, d, C = 7, 8, 12, 2, 2, 20
    pred = FineMoEPredictor(ModelShape(L, E, k, H), distance=d, capacity=C)
    pred.runtime_mode = True
    pred.store.add(torch.softmax(3 * torch.randn(C, L, E, generator=g), -1), torch.randn(C, H, generator=g))
    freq, prev_embed = torch.zeros(L, E), None
    for _ in range(6):  # iterations; each publishes its map into the full store (a replacement)
        embed = torch.randn(1, H, generator=g)
        maps, sems = pred.store.maps[: pred.store.size].clone(), pred.store.sems[: pred.store.size].clone()
        pred.end_iteration()
        if prev_embed is not None:  # the previous iteration's map replaced the most redundant stored one
            traj_prev = pred._traj[0].reshape(1, -1)
            rdy = d / L * _cosine(prev_embed, sems) + (L - d) / L * _cosine(traj_prev, maps.reshape(C, -1))
            assert torch.equal(pred.store.maps[int(rdy.argmax())], pred._traj[0])
        pred.begin_iteration(embed)
        prev_embed = embed
        for layer in range(L):
            probs = torch.softmax(3 * torch.randn(1, E, generator=g), -1)
            top = torch.topk(probs, k).indices
            freq[layer, top[0]] += 1
            pred.observe(layer, None, probs, top)
            got = pred.runtime_proposals(layer)
            if layer + d >= L:
                assert got == []
                continue
            if layer == 0:
                score, idx = _cosine(embed, pred.store.sems[: pred.store.size]).max(1)
            else:
                score, idx = _cosine(pred._traj[:, :layer].reshape(1, -1),
                                     pred.store.maps[: pred.store.size, :layer].reshape(pred.store.size, -1)).max(1)
            p = pred.store.maps[idx, layer + d]
            assert got == [(layer + d, ranked_selection(p.numpy(), score.numpy(), k, d))]
            assert torch.equal(pred.guidance[layer + d], p[0])
        assert torch.equal(pred.freq, freq)


def test_plec_vectorised_pick_is_the_correction_order():
    rng = random.Random(0)
    for _ in range(500):
        L, E = rng.randint(1, 6), rng.randint(1, 6)
        state = PLECState(L, E)
        ev = PLECEviction(state)
        ev.vectorise_from = 0  # the array path whatever the number of candidates
        keys = [(layer, e) for layer in range(L) for e in range(E)]
        state.new_pass({layer: rng.sample(range(E), rng.randint(0, E)) for layer in range(L)})
        for _ in range(rng.randint(0, 30)):
            state.layer_now = rng.randint(-1, L - 1)
            (ev.access if rng.random() < 0.5 else ev.loaded)(rng.choice(keys))
        if rng.random() < 0.5:  # the dual-batch pipeline's next plan
            upcoming = {layer: rng.sample(range(E), rng.randint(0, E)) for layer in range(L)}
            state.upcoming = lambda upcoming=upcoming: upcoming
            state.poll_upcoming()
        now = rng.randint(-1, L - 1)
        cands = [key for key in keys if rng.random() < 0.6]
        flags = np.zeros((L, E), dtype=bool)
        for key in cands:
            flags[key] = True
        want = ev.victim(cands, now) if cands else None
        assert ev.pick(dict.fromkeys(cands), now, None, flags) == want


def _random_history(policy, rng: random.Random, keys: list, steps: int, p_access: float, p_load: float,
                    at_step=None) -> set:
    """Drive ``policy`` through random gate accesses, loads and evictions of ``keys``; returns the resident keys.
    ``at_step(step)`` runs after each step (e.g. a phase switch)."""
    resident: set = set()
    for step in range(steps):
        key = rng.choice(keys)
        action = rng.random()
        if action < p_access:
            policy.access(key)
        elif action < p_load and key not in resident:
            policy.loaded(key)
            resident.add(key)
        elif key in resident:
            policy.evicted(key)
            resident.discard(key)
        if at_step is not None:
            at_step(step)
    return resident


def test_static_ring_pick_is_the_static_order():
    """Static's own ring dict picks what its order (placement last, least recent first) picks."""
    rng = random.Random(1)
    for _ in range(300):
        policy = Static(n_fixed=rng.randint(0, 6))
        keys = [(layer, e) for layer in range(3) for e in range(4)]
        # step 20 freezes the placement from the gate counts so far
        resident = _random_history(policy, rng, keys, 40, 0.4, 0.7,
                                   at_step=lambda step, p=policy: p.on_phase("decode") if step == 20 else None)
        evictable = [k for k in resident if rng.random() < 0.7]
        want = policy.victim(evictable, 0) if evictable else None
        assert policy.pick(dict.fromkeys(evictable), 0) == want


def test_lru_pick_in_layer_is_the_filtered_global_pick():
    """LRU's per-layer order (per-layer quotas) picks what a walk of the global order filtered to the layer picks,
    and what the plain least-recent order over that layer's candidates picks."""
    rng = random.Random(2)
    for _ in range(300):
        policy = LRU()
        keys = [(layer, e) for layer in range(3) for e in range(5)]
        resident = _random_history(policy, rng, keys, 50, 0.45, 0.75)
        evictable = dict.fromkeys(k for k in resident if rng.random() < 0.7)
        for layer in range(3):
            got = policy.pick_in_layer(evictable, 0, layer)
            assert got == policy.pick(evictable, 0, lambda k, layer=layer: k[0] == layer)
            own = [k for k in evictable if k[0] == layer]
            assert got == (policy.victim(own, 0) if own else None)


def _claim_chunk_by_chunk(high_q, low_q, batch_bytes):
    """The copy engine's claim as first written: one (task, start, end) per chunk, then merged per task."""
    high = bool(high_q)
    queue_ = high_q if high else low_q
    pieces, total = [], 0
    while queue_:
        task = queue_[0]
        a, b = task.chunks[task.next_chunk]
        if pieces:
            if not high:
                break
            if task is not pieces[-1][0]:
                if total + sum(hi - lo for lo, hi in task.chunks[task.next_chunk:]) > batch_bytes:
                    break
            elif total + (b - a) > batch_bytes:
                break
        pieces.append((task, a, b))
        total += b - a
        task.next_chunk += 1
        if task.next_chunk == len(task.chunks):
            queue_.popleft() if high else queue_.pop(0)
    merged = []
    for task, a, b in pieces:
        if merged and merged[-1][0] is task:
            merged[-1] = (task, merged[-1][1], b)
        else:
            merged.append((task, a, b))
    return merged


def test_claim_takes_the_chunks_the_chunk_by_chunk_claim_takes():
    """One piece per task (its claimed chunks as one byte range): the same chunks, tasks and queues as claiming
    chunk by chunk, for needed batches within and beyond ``batch_bytes`` and one-chunk predictions."""
    from collections import deque
    from types import SimpleNamespace

    rng = random.Random(4)
    for _ in range(400):
        queues = []
        for _ in range(2):
            tasks = {}
            for i in range(rng.randint(0, 5)):  # each task twice: one for each claim
                ranges = tuple(chunk_ranges(rng.choice((96, 512, 4096)), rng.randint(1, 4), align=32))
                started = rng.randrange(len(ranges)) if rng.random() < 0.3 else 0  # chunks already issued
                tasks[i] = [LoadTask(0, i, i, True, ranges, next_chunk=started) for _ in range(2)]
            queues.append(tasks)
        high, low = list(queues[0].values()), list(queues[1].values())
        budget = rng.choice((0, 64, 200, 1000, 8192))
        fast = SimpleNamespace(_high=deque(t[0] for t in high), _low=[t[0] for t in low], batch_bytes=budget)
        got = CopyEngine._claim(fast)
        ref_high, ref_low = deque(t[1] for t in high), [t[1] for t in low]
        ref = _claim_chunk_by_chunk(ref_high, ref_low, budget)
        assert [(t.expert, a, b) for t, a, b in got] == [(t.expert, a, b) for t, a, b in ref]
        assert [t.next_chunk for t in fast._high] == [t.next_chunk for t in ref_high]
        assert [t.next_chunk for t in fast._low] == [t.next_chunk for t in ref_low]
        assert all(t.in_transit == 1 for t, _, _ in got)
        assert [(t.expert, t.next_chunk) for ts in high + low for t in ts[:1]] == \
            [(t.expert, t.next_chunk) for ts in high + low for t in ts[1:]]
