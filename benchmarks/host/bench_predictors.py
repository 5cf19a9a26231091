"""pytest-benchmark: predictor overhead per MoE layer (one decode token), at Mixtral-8x7B and tiny shapes.

One round = what the runtime does at one layer: ``observe`` the layer's routing, ``predict`` the layer
``distance`` ahead and turn the scores into a prefetch set. Weights are random (the cost does not depend
on training); FineMoE's store is full (1000 maps, the paper's capacity). On a CUDA machine the learned
predictors run on the GPU (FineMoE's store stays in host memory, as in the paper).

    python -m pytest benchmarks/host/bench_predictors.py --benchmark-json=predictors.json
"""

from __future__ import annotations

import pytest
import torch

from moeflow.offload.predictors import (
    DuoServePredictor,
    FineMoEPredictor,
    ModelShape,
    PopularityPredictor,
    ProMoEPredictor,
    SkipGatePredictor,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPES = {"mixtral-8x7b": ModelShape(32, 8, 2, 4096), "tiny": ModelShape(4, 8, 2, 128)}
KINDS = ("popularity", "skip-gate", "duoserve", "promoe", "finemoe")


def _make(kind: str, shape: ModelShape):
    L, E, H = shape.num_layers, shape.num_experts, shape.hidden_size
    if kind == "popularity":
        return PopularityPredictor(shape, 1)
    if kind == "skip-gate":
        return SkipGatePredictor.from_gates(list(torch.randn(L, E, H) * 0.02), shape.top_k, 1).to(DEVICE)
    if kind == "duoserve":
        return DuoServePredictor(shape, 1).to(DEVICE)
    if kind == "promoe":
        return ProMoEPredictor(shape, 2).to(DEVICE)
    pred = FineMoEPredictor(shape, 3, online=False)
    maps = torch.softmax(torch.randn(pred.capacity, L, E), -1)
    pred.store.add(maps, torch.randn(pred.capacity, H))
    return pred


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_predictor_overhead_per_layer(benchmark, kind, shape):
    torch.set_num_threads(1)
    s = SHAPES[shape]
    pred = _make(kind, s)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(s.num_layers, 1, s.hidden_size, generator=gen).to(DEVICE)  # [L, T=1, H]
    probs = torch.softmax(torch.randn(s.num_layers, 1, s.num_experts, generator=gen), -1).to(DEVICE)  # [L, 1, E]
    topk = torch.topk(probs, s.top_k, dim=-1).indices.to(torch.int32)  # [L, 1, k]
    d = pred.distance
    layer = min(s.num_layers // 2, s.num_layers - 1 - d)  # a middle layer (a long trajectory for FineMoE)
    pred.begin_iteration(torch.randn(1, s.hidden_size).to(DEVICE))
    for l in range(layer):
        pred.observe(l, hidden[l], probs[l], topk[l])

    def one_layer():
        pred.observe(layer, hidden[layer], probs[layer], topk[layer])
        pred._found.pop(layer + d, None) if kind == "finemoe" else None  # search again every round
        mask = pred.predicted_mask(pred.predict(layer + d), layer + d)
        if CUDA:
            torch.cuda.synchronize()
        return mask

    benchmark.pedantic(one_layer, rounds=200, iterations=1, warmup_rounds=10)
    benchmark.extra_info.update(device=DEVICE, layer=layer, distance=d, **{f"shape_{k}": v for k, v in
                                                                             vars(s).items()})
