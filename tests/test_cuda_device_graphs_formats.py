"""The captured device part over the gpt-oss and GGUF formats on a lent GPU, with the kernels compiled:

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_device_graphs_formats.py

What the CPU recording stand-in (tests/test_device_graphs_formats.py, tests/test_device_graphs_models.py) cannot
show: that the compiled MXFP4, biased AWQ and GGUF Triton launches over the bucket's persistent buffers (plan,
``h``, split-K partials; the split-K counters left zero by the kernels) are accepted by a real CUDA-graph capture
and replayed bitwise as the eager launches on new routing, slot tables and activations; and that
``cuda_graphs=True`` decoding on these models keeps the resident tokens with no layer run eagerly. Not yet run
(no GPU lent when it was written). Skipped without CUDA and under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_device_graphs_formats import POOLS, _inputs
from test_device_graphs_models import LAYERS, TOP_K, checkpoints  # noqa: F401 (the fixture)

from moeflow import MoEModel, OffloadConfig
from moeflow.kernels.pool import ExpertPool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the compiled kernels are the subject"),
]


@pytest.mark.parametrize("name", ["mxfp4", "biased-awq", "gguf-q8_0", "gguf-q4_k-q6_k"])
def test_a_cuda_graph_of_the_captured_forward_replays_the_eager_kernels_bitwise(name):
    cpu_pool = POOLS[name](torch.Generator().manual_seed(3))
    fmt, dev = cpu_pool.fmt, torch.device("cuda")
    pool = ExpertPool(fmt, cpu_pool.buffer.to(dev))
    calls = [tuple(t.to(dev) for t in c) for c in _inputs(fmt.hidden_size, torch.Generator().manual_seed(4), 4)]
    x, ids, w, slots, mask = (torch.zeros_like(t) for t in calls[0])
    out = torch.zeros(ids.numel(), fmt.hidden_size, device=dev)
    buffers: dict[str, torch.Tensor] = {}

    def alloc(n, shape, dtype, device):
        if n not in buffers:
            buffers[n] = torch.empty(shape, dtype=dtype, device=device)
        return buffers[n]

    forward = fmt.captured_forward(pool, x, ids, w, slots, mask, out, "triton", alloc)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    for buf, value in zip((x, ids, w, slots, mask), calls[0], strict=True):
        buf.copy_(value)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # the warm-up: buffers made, kernels compiled
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        forward()
    for i, call in enumerate(calls):
        for buf, value in zip((x, ids, w, slots, mask), call, strict=True):
            buf.copy_(value)
        out.fill_(7.0)
        graph.replay()
        want = fmt.forward(*call[:3], pool, call[3], torch.full_like(out, 7.0), call[4], "triton")
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"{name} call {i}: {(out - want).abs().max()}"


@pytest.mark.parametrize("model", ["mxfp4", "biased-awq", "gguf"])
def test_cuda_graphs_decode_these_models_with_the_captured_device_part(checkpoints, model):  # noqa: F811
    load = dict(device="cuda", dtype=torch.bfloat16, kernels="auto")
    resident = MoEModel.from_pretrained(checkpoints[model], **load, offload=OffloadConfig(policy="resident"),
                                        cuda_graphs=False)
    resident.runner.reuse_cache = True  # the graph run's bucketed cache length: only replay vs eager differs
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0)).cuda()
    expected = resident.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    resident.close()
    model_ = MoEModel.from_pretrained(checkpoints[model], **load, cuda_graphs=True,
                                      offload=OffloadConfig(policy="lru", gpu_expert_slots=TOP_K + 1))
    try:
        got = model_.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
        step, device = model_.runner.decode_fn, model_.experts.device_graphs
    finally:
        model_.close()
    assert step.refused is None, step.refused
    assert device.disabled is None and device.refused == {}, (device.disabled, device.refused)
    assert device.captures == 1 and device.eager_layers == 0 and device.replays > 2 * 10 * LAYERS
    assert torch.equal(got, expected)
