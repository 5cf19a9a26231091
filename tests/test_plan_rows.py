"""``plan_rows``: which activation row each row of an expert GEMM tile reads (interpreter). Padding rows are never
stored, but they must read memory that was written: w2's padding rows read their block's first pair (computed
for the block's own expert), not pair 0, whose row a staged run may not have computed yet."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moeflow.kernels.experts.ops import routing_plan
from moeflow.kernels.triton_common import plan_rows

BLOCK_M, DOT_M, TOPK = 4, 16, 2


@triton.jit
def _rows_kernel(sorted_ptr, out_ok, out_row, num_pairs, BLOCK_M: tl.constexpr, DOT_M: tl.constexpr,
                 TOPK: tl.constexpr, MODE: tl.constexpr):
    pid_m = tl.program_id(0)
    _, row_ok, row = plan_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, DOT_M, TOPK, MODE)
    r = tl.arange(0, DOT_M)
    tl.store(out_ok + pid_m * DOT_M + r, row_ok.to(tl.int32))
    tl.store(out_row + pid_m * DOT_M + r, row)


@pytest.mark.parametrize("mode", [0, 1])
def test_padding_rows_read_rows_of_their_own_block(mode):
    topk_ids = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 1], [2, 0]])  # 5 tokens x top-2 over 4 experts
    num_pairs = topk_ids.numel()
    sorted_ids, expert_of_block, _ = routing_plan(topk_ids, 4, BLOCK_M, "triton")
    blocks = int((expert_of_block >= 0).sum())
    ok = torch.zeros((blocks, DOT_M), dtype=torch.int32)
    rows = torch.zeros((blocks, DOT_M), dtype=torch.int64)
    _rows_kernel[(blocks,)](sorted_ids, ok, rows, num_pairs, BLOCK_M, DOT_M, TOPK, mode)
    padded = 0
    for b in range(blocks):
        pairs = sorted_ids[b * BLOCK_M:(b + 1) * BLOCK_M].long()
        real = pairs[pairs < num_pairs]
        assert real.numel() and int(pairs[0]) == int(real[0])  # a live block starts with a real pair
        want_real = real // TOPK if mode == 0 else real
        assert torch.equal(rows[b, : real.numel()], want_real) and bool(ok[b, : real.numel()].all())
        assert not ok[b, real.numel():].any()
        pad = rows[b, real.numel():]
        padded += pad.numel()
        # MODE 0 reads token 0 (always an input row); MODE 1 the block's first pair (its expert's, so computed)
        assert bool((pad == (0 if mode == 0 else int(real[0]))).all()), (b, pad)
    assert padded > 0 and any(int(sorted_ids[b * BLOCK_M]) != 0 for b in range(blocks))
