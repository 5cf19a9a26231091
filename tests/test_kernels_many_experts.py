"""Many small experts (Qwen3-MoE: 128 x top-8; the plan must hold up to E = 256, top-k = 10): the routing plan
and the grouped expert GEMMs under the interpreter against the torch reference and a per-token fp32 loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _check_plan_invariants, make_pool, make_routing

from moeflow import kernels
from moeflow.kernels.experts.reference import expert_weights_reference, routing_plan_reference


@pytest.mark.parametrize("E,k", [(64, 8), (128, 8), (256, 10)])
@pytest.mark.parametrize("T,bm", [(1, 1), (3, 4), (17, 16)])
@pytest.mark.parametrize("mode", ["uniform", "skewed"])
def test_plan_many_experts(E, k, T, bm, mode):
    ids, _ = make_routing(T, k, E, mode, seed=E + T)
    ref = routing_plan_reference(ids, E, bm)
    _check_plan_invariants(ids, E, bm, ref)
    for got, want in zip(torch.ops.moeflow.routing_plan(ids, E, bm, "triton"), ref, strict=True):
        assert torch.equal(got, want)


def per_token_loop(x, ids, weights, pool, slot_of_expert):
    """fp32 [T, H]: for each token, sum over its k experts of weight * down(silu(gate) * up)."""
    inter = pool.fmt.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w13, w2 = expert_weights_reference(pool, int(slot_of_expert[ids[t, j]]))
            h = x[t].float() @ w13
            out[t] += float(weights[t, j]) * ((F.silu(h[:inter]) * h[inter:]) @ w2)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("E,k,T", [(128, 8, 1), (256, 10, 3), (256, 10, 9)])
def test_moe_forward_many_experts(backend, E, k, T):
    H, I, g = 32, 32, 32  # noqa: E741
    pool = make_pool(H, I, E, g, torch.float32, seed=E)
    slot = torch.randperm(E, generator=torch.Generator().manual_seed(T)).to(torch.int32)  # scattered slots
    ids, w = make_routing(T, k, E, "uniform", seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(k))
    got = kernels.moe_forward(x, ids, w, pool, slot, backend)
    want = per_token_loop(x, ids, w, pool, slot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
