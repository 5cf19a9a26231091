"""pytest-benchmark suite of the expert kernels (Mixtral shapes on CUDA; the tiny shape anywhere).

On CUDA it times the Triton path; on a CPU the torch reference (the interpreter is not worth timing).
The full GPU report with bandwidth / cuBLAS / baseline ratios is ``benchmarks/gpu/kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu.kernels import GROUP, SHAPES, TOKENS, per_expert_loop, random_awq_pool, random_routing
from moeflow import kernels
from moeflow.quant.awq import quantize_rtn

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "triton" if CUDA else "torch"
_POOLS: dict = {}


def _pool(shape):
    if shape not in _POOLS:
        _POOLS.clear()  # one big pool at a time
        H, I, E, _ = SHAPES[shape]  # noqa: E741
        _POOLS[shape] = random_awq_pool(H, I, E, torch.bfloat16, DEVICE)
    return _POOLS[shape]


def _params():
    for shape in SHAPES:
        for T in TOKENS if shape != "tiny" else (1, 16, 64):
            marks = [] if CUDA or shape == "tiny" else [pytest.mark.skip(reason="needs CUDA")]
            yield pytest.param(shape, T, marks=marks, id=f"{shape}-T{T}")


def _run(benchmark, fn):
    def timed():
        out = fn()
        if CUDA:
            torch.cuda.synchronize()
        return out

    benchmark.pedantic(timed, rounds=10, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize(("shape", "T"), list(_params()))
def test_moe_forward(benchmark, shape, T):
    H, I, E, k = SHAPES[shape]  # noqa: E741
    pool = _pool(shape)
    slot = torch.arange(E, dtype=torch.int32, device=DEVICE)
    ids, w = random_routing(T, E, k, DEVICE, seed=T)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    benchmark.extra_info.update({"backend": BACKEND, "flops": 6 * T * k * H * I})
    _run(benchmark, lambda: kernels.moe_forward(x, ids, w, pool, slot, BACKEND, validate=False))


@pytest.mark.parametrize(("shape", "T"), [p for p in _params() if p.values[1] in (1, 64)])
def test_per_expert_bf16_loop(benchmark, shape, T):
    H, I, E, k = SHAPES[shape]  # noqa: E741
    ids, w = random_routing(T, E, k, DEVICE, seed=T)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    w13 = [torch.randn(H, 2 * I, device=DEVICE, dtype=torch.bfloat16) * 0.01 for _ in range(E)]
    w2 = [torch.randn(I, H, device=DEVICE, dtype=torch.bfloat16) * 0.01 for _ in range(E)]
    _run(benchmark, lambda: per_expert_loop(x, ids, w, w13, w2, I))


@pytest.mark.parametrize("M", [1, 16, 512])
def test_awq_linear(benchmark, M):
    K, N = (4096, 4096) if CUDA else (256, 256)
    q = quantize_rtn(torch.randn(N, K) * 0.02, GROUP)
    qw, qz, sc = (t.to(DEVICE) for t in (q.qweight, q.qzeros, q.scales))
    x = torch.randn(M, K, device=DEVICE, dtype=torch.float16)
    _run(benchmark, lambda: kernels.awq_linear(x, qw, qz, sc, GROUP, BACKEND))
