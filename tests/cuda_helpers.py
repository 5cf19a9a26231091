"""Helpers of the GPU-only tests (tests/test_cuda_*.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_bitwise_stable(launch: Callable[[], torch.Tensor], out: torch.Tensor, first: torch.Tensor,
                          runs: int = 50) -> None:
    """``launch()`` (writing ``out``) gives ``first``'s bits ``runs`` times eagerly and ``runs`` times as a CUDA-graph
    replay, and leaves the split-K counters of both streams at zero: the check of a kernel whose programs race to
    a per-tile counter (the interpreter runs one program at a time and cannot show a visibility race)."""
    from moeflow.kernels import workspace

    for _ in range(runs):  # hundreds to thousands of programs racing to each tile's counter, every launch
        assert torch.equal(launch(), first)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # this stream's counters made before the capture
        with torch.cuda.graph(graph, stream=stream):
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(runs):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)
    torch.cuda.synchronize()
    for on in (torch.cuda.current_stream(), stream):  # each stream's own counters (the buffers already exist)
        with torch.cuda.stream(on):
            assert int(torch.count_nonzero(workspace.counters(1, out.device))) == 0
