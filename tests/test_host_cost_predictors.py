"""Issue 14: the learned predictors' per-layer fast paths give bitwise what their plain forms give.

DuoServe's one-row state kept in one buffer across an iteration (``DecodeState``), the MLPs run as direct torch
calls (``EvalSequential``) on the shipped predictor files, and the one-row proposal, each against the reference
it replaces. The policies' decisions on the no-op benchmark driver are unchanged too (checked by the branch's
decision log, see benchmarks/results/host_overhead/README.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeflow.cli import embedded_model_path
from moeflow.offload.predictors import DuoServePredictor, ModelShape, load_predictor
from moeflow.offload.predictors.eval_mlp import EvalSequential, cpu_batch_norm_affine

SHIPPED = embedded_model_path() / "predictors"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", ["duoserve", "promoe"])
def test_eval_sequential_is_bitwise_the_shipped_modules(kind):
    """The shipped predictors' MLPs (trained BatchNorm statistics) as direct calls: the modules' bit patterns for
    one row (decode) and several, under inference_mode and no_grad."""
    pred = load_predictor(SHIPPED / f"{kind}.pt")
    mlps = [pred.mlp] if kind == "duoserve" else list(pred.mlps)
    g = torch.Generator().manual_seed(0)
    for mlp in mlps:
        assert not mlp.training
        fast = EvalSequential(mlp)
        width = next(m for m in mlp if isinstance(m, nn.Linear)).in_features
        for rows in (1, 2, 7):
            x = torch.randn(rows, width, generator=g) * 2
            if kind == "duoserve":  # states are mostly 0/1 with probabilities: those too
                x[:, : width // 2] = (x[:, : width // 2] > 0.5).float()
            with torch.no_grad():
                ref = mlp(x)
                assert torch.equal(_bits(fast(x)), _bits(ref))
            with torch.inference_mode():
                assert torch.equal(_bits(fast(x)), _bits(ref))
            assert torch.equal(x, x.clone())  # the input untouched (ReLU runs in place on intermediates only)


def test_batch_norm_affine_is_the_kernel_beyond_its_probe():
    """Where the planned (alpha, beta) are accepted, addcmul gives the CPU kernel's bits on inputs the probe never
    saw: other seeds, huge and tiny values, zeros of both signs, infinities; a layer whose beta has a zero of
    the wrong sign is refused (the kernel is kept)."""
    pred = load_predictor(SHIPPED / "duoserve.pt")
    g = torch.Generator().manual_seed(11)
    for bn in (m for m in pred.mlp if isinstance(m, nn.BatchNorm1d)):
        with torch.no_grad():
            affine = cpu_batch_norm_affine(bn)
        if affine is None:  # this build's kernel computes otherwise: nothing to check
            continue
        alpha, beta = affine
        x = torch.randn(33, bn.num_features, generator=g) * torch.logspace(-30, 30, 33)[:, None]
        x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
        with torch.inference_mode():
            ref = torch.batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, False, 0.0, bn.eps, True)
            assert torch.equal(_bits(torch.addcmul(beta, x, alpha)), _bits(ref))
    bn = nn.BatchNorm1d(4).eval()
    with torch.no_grad():
        bn.bias.copy_(torch.tensor([-0.0, 1.0, 2.0, 3.0]))  # mean 0: beta = -0 - 0 * alpha = -0
        assert cpu_batch_norm_affine(bn) is None


def test_eval_sequential_replans_after_the_parameters_change():
    """load_state_dict, a call in training mode (an optimizer step may follow) and reset() drop the plan."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)).eval()
    other = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():
        other[1].running_mean.uniform_(-1, 1)
        other[1].running_var.uniform_(0.5, 2)
    fast = EvalSequential(mlp)
    x = torch.randn(2, 6)
    with torch.no_grad():
        assert torch.equal(fast(x), mlp(x))
        mlp.load_state_dict(other.state_dict())
        assert torch.equal(fast(x), mlp(x)) and torch.equal(fast(x), other.eval()(x))
    mlp.train()
    fast(torch.randn(4, 6))  # training mode: the module; the plan is dropped
    with torch.no_grad():
        mlp[1].running_var.mul_(3.0)
    mlp.eval()
    with torch.no_grad():
        assert torch.equal(fast(x), mlp(x))
        mlp[1].bias.add_(1.0)
        fast.reset()
        assert torch.equal(fast(x), mlp(x))


def test_eval_sequential_leading_relu_leaves_the_input_alone():
    seq = nn.Sequential(nn.ReLU(), nn.Linear(4, 3), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    before = x.clone()
    with torch.inference_mode():
        assert torch.equal(EvalSequential(seq)(x), seq(x))
    assert torch.equal(x, before)


def _duoserve(L: int, distance: int) -> DuoServePredictor:
    g = torch.Generator().manual_seed(L * 10 + distance)
    shape = ModelShape(L, 8, 2, 16)
    pop = torch.rand(L, 8, generator=g)
    p = DuoServePredictor(shape, distance, pop / pop.sum(-1, keepdim=True))
    aff = torch.rand(L - distance, 8, 8, generator=g)
    p.affinity = aff / aff.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize("distance", [1, 2])
def test_one_row_state_is_the_state_vector(distance):
    """DecodeState's buffer, layer by layer over several iterations (announced or not, repeated ids included), is
    state_vector of the observed path; an earlier target after later layers, or several rows, use the reference."""
    L = 5
    p = _duoserve(L, distance)
    g = torch.Generator().manual_seed(distance)
    for it in range(4):
        if it != 2:  # iteration 2 starts by observing layer 0 again, unannounced
            p.begin_iteration()
        for layer in range(L):
            ids = torch.randperm(8, generator=g)[:2].view(1, 2).to(torch.int32)
            if it == 3 and layer == 1:
                ids[0, 1] = ids[0, 0]  # the same expert twice
            probs = torch.softmax(torch.randn(1, 8, generator=g), -1)
            p.observe(layer, None, probs, ids)
            target = layer + distance
            if target >= L:
                continue
            path = torch.stack([p._topk[s] for s in range(layer + 1)], dim=1)
            ref = p.state_vector(path, target)
            got = p._one_row_state(target, layer)
            assert got is not None and torch.equal(_bits(got), _bits(ref))
            assert torch.equal(_bits(p.predict(target)), _bits(torch.sigmoid(p.mlp(ref))))
        if distance == 1:  # an earlier target after the whole path: the reference path, the same scores
            assert p._one_row_state(2, 1) is None
            path = torch.stack([p._topk[s] for s in range(2)], dim=1)
            assert torch.equal(p.predict(2), torch.sigmoid(p.mlp(p.state_vector(path, 2))))
    p.begin_iteration()  # a layer observed twice in one iteration: the state of its latest ids
    for layer, ids in ((0, [1, 2]), (1, [3, 4]), (1, [5, 6]), (2, [7, 0])):
        p.observe(layer, None, torch.full((1, 8), 1 / 8), torch.tensor([ids], dtype=torch.int32))
        if layer + distance < L:
            path = torch.stack([p._topk[s] for s in range(layer + 1)], dim=1)
            assert torch.equal(p._one_row_state(layer + distance, layer), p.state_vector(path, layer + distance))
    p.begin_iteration()
    p.observe(0, None, torch.full((2, 8), 1 / 8), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    assert p._one_row_state(distance, 0) is None  # two rows: the general state


def test_one_row_proposal_is_the_padded_top_k():
    """A decode step's proposal: the top-k of the scores, most wanted first, then -1 up to E."""
    p = load_predictor(SHIPPED / "duoserve.pt")
    E, k = p.shape.num_experts, p.shape.top_k
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for layer in range(p.shape.num_layers):
            ids = torch.randperm(E, generator=g)[:k].view(1, k).to(torch.int32)
            p.observe(layer, None, torch.full((1, E), 1 / E), ids)
            got = p.propose(layer, torch.zeros(1, 4))
            if layer + 1 >= p.shape.num_layers:
                assert got == []
                continue
            (target, proposed), = got
            scores = p.predict(target)
            want = torch.full((E,), -1, dtype=torch.int64)
            want[:k] = torch.topk(scores[0], k).indices
            assert target == layer + 1 and torch.equal(proposed, want)


def test_duoserve_on_the_cpu_collects_its_proposal_without_a_host_copy():
    """On the CPU the prediction's ids are read where they are (no copy into a host buffer): the same ids the
    learned predictor proposed, at the layer's first poll, once."""
    from moeflow.offload.policies.duoserve import OverlappedPredictor

    runtime = OverlappedPredictor(load_predictor(SHIPPED / "duoserve.pt"), "cpu")
    pred = runtime.predictor
    E, k = pred.shape.num_experts, pred.shape.top_k
    assert runtime._copy.host is None  # no host buffer to copy into
    with torch.inference_mode():
        ids = torch.tensor([[1, 4]], dtype=torch.int32)
        runtime.observe(0, torch.zeros(1, 4), torch.full((1, E), 1 / E), ids)
        (target, want), = pred.propose(0, torch.zeros(1, 4))
        assert runtime.collect_proposals(1) == []  # another layer's poll
        assert runtime.collect_proposals(0) == [(target, want.tolist())] and target == 1
        assert runtime.collect_proposals(0) == []  # collected once
        assert sum(e >= 0 for e in want.tolist()) == k
