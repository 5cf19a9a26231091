"""The MXFP4 split-K fixup with real concurrency (a lent GPU; the interpreter runs one program at a time and
cannot show a visibility race):

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_mxfp4_splitk.py

Both stages at gpt-oss-120b shapes (H = I = 2880, bias, clamped SwiGLU) with the decode default splits and 2 / 4
/ 8: close to the unsplit launch, bitwise the same over many launches and CUDA-graph replays, counters back at
zero; the pool's K-panel layout and the row-major one read through strides give bitwise the same output. Skipped
without CUDA, and under the interpreter.
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

H, I, E, K = 2880, 2880, 16, 4  # noqa: E741  gpt-oss-120b's expert shapes, 16 experts in the pool, top-4


@pytest.fixture(scope="module")
def pool():
    from test_mxfp4 import mxfp4_pool

    from moeflow.kernels.pool import ExpertPool

    cpu = mxfp4_pool(H, I, E, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    return ExpertPool(cpu.fmt, cpu.buffer.cuda())


@pytest.mark.parametrize("T, split", [(1, None), (1, 2), (4, 4), (4, 8), (16, None)])
def test_mxfp4_split_k_is_bitwise_stable_across_launches_and_replays(pool, T, split):
    from cuda_helpers import assert_bitwise_stable

    from moeflow.kernels.experts import mxfp4

    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    ids = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1)
    slots = torch.arange(E, dtype=torch.int32, device="cuda")
    out = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    config = None if split is None else {"w13": {"SPLIT_K": split}, "w2": {"SPLIT_K": split}}
    assert max(c["SPLIT_K"] for c in mxfp4.stage_configs(T, E, K, H, I, config).values() if isinstance(c, dict)) > 1

    def launch(cfg=config) -> torch.Tensor:
        return mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, out, config=cfg)

    unsplit = launch({"w13": {"SPLIT_K": 1}, "w2": {"SPLIT_K": 1}}).clone()
    first = launch().clone()
    # the fixup's sum = one program's sum up to fp32 order; h and the outputs rounded to bf16
    assert float((first.float() - unsplit.float()).abs().max() / unsplit.float().abs().max()) < 2e-2
    assert_bitwise_stable(launch, out, first)


@pytest.mark.parametrize("T", [1, 16, 128])  # decode (split), T = 16, a pipelined prefill tile (BLOCK_M 64)
def test_mxfp4_panel_and_row_major_layouts_are_bitwise_equal(pool, T):
    from moeflow.kernels.experts import mxfp4

    gen = torch.Generator(device="cuda").manual_seed(100 + T)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    ids = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1)
    slots = torch.arange(E, dtype=torch.int32, device="cuda")
    row_major = mxfp4.row_major_copy(pool)
    panels = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.empty(T * K, H, dtype=torch.bfloat16,
                                                                             device="cuda"))
    rows = mxfp4.mxfp4_expert_forward(x, ids, w, pool, slots, torch.empty_like(panels), weights=row_major)
    assert torch.isfinite(panels).all() and torch.equal(panels, rows)
