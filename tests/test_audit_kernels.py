"""The split-K fixup's summation order (moeflow/kernels/triton_common.py, under TRITON_INTERPRET=1): the reducing
program sums the tile's fp32 partials in split order 0..S-1, as documented (the same bits whoever arrives last).
Summing them in another order keeps the tokens but not the bits; issue 35's audit found no test that saw it."""

from __future__ import annotations

import torch
from test_biased_kernels import biased_awq_pool
from test_kernels import make_routing
from test_splitk_fixup import E, G, H, K, T, launch


def test_the_fixup_sums_the_partials_in_split_order_bitwise():
    """w2 (MODE 1, K = 128: four tiles of 32) with routing weights, no bias, split 4: the output is, bit for bit,
    the workspace's partials [S, P, N] summed 0, 1, 2, 3 in fp32 times each pair's weight; the reverse order gives
    other bits here."""
    gen = torch.Generator().manual_seed(6)
    pool, _ = biased_awq_pool(H, 128, G, E, gen)
    ids, w = make_routing(T, K, E, seed=6)
    w = w.float()
    h = torch.randn(ids.numel(), 128, generator=gen)
    split = 4
    ws = torch.full((split, ids.numel(), H), float("nan"))
    got = launch(1, pool, ids, h, split, False, w=w, block_n=128, ws=ws)
    assert not ws.isnan().any()  # every pair's partials stored

    def summed(order) -> torch.Tensor:
        total = torch.zeros_like(ws[0])
        for s in order:
            total = total + ws[s]
        return total * w.reshape(-1, 1)

    assert torch.equal(got, summed(range(split)))
    assert not torch.equal(got, summed(reversed(range(split))))  # the data tells the orders apart
