"""The panel-major AWQ qweight with the kernels compiled (a lent GPU): at Mixtral-8x7B shapes the MoE forward
reads the pool's panels and the former row-major layout (``pool.row_major_pool``, through strides) to bitwise
the same output, from decode (split-K fixup) to prefill tiles (BLOCK_K half a panel):

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_panel_layout.py

Skipped without CUDA, and under the interpreter (tests/test_panel_layout.py covers it there at small shapes).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the lane checks the compiled kernels"),
]

H, I, E, K, G = 4096, 14336, 8, 2, 128  # noqa: E741  Mixtral-8x7B


@pytest.fixture(scope="module")
def pools():
    from moeflow.kernels.formats import expert_format
    from moeflow.kernels.pool import ExpertPool, row_major_pool

    fmt = expert_format(H, I, "awq", torch.bfloat16, G)
    pool = ExpertPool.allocate(fmt, E, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, t in pool.tensors.items():  # random nibbles, mid zeros, small scales: any bytes are a valid expert
        if name.endswith("qweight"):
            t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, device="cuda", dtype=torch.int64))
        elif name.endswith("qzeros"):
            t.fill_(0x88888888 - 2**32)
        else:
            t.copy_(torch.rand(t.shape, generator=gen, device="cuda") * 4e-3)
    return pool, row_major_pool(pool)


@pytest.mark.parametrize("T", [1, 2, 16, 64, 512])
def test_panels_and_row_major_give_the_same_bits(pools, T):
    from moeflow import kernels

    pool, rows = pools
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = (torch.randn(T, H, generator=gen, device="cuda") * 0.5).bfloat16()
    logits = torch.randn(T, E, generator=gen, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()
    slot = torch.arange(E, dtype=torch.int32, device="cuda")
    got = kernels.moe_forward(x, ids, w, pool, slot, "triton", validate=False)
    ref = kernels.moe_forward(x, ids, w, rows, slot, "triton", validate=False)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert torch.equal(got, ref)
