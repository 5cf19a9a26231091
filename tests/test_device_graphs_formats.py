"""The captured device part over the gpt-oss and GGUF expert formats (issue 39 item 3; moeflow/offload/device_step.py,
``ExpertFormat.captured_forward``): MXFP4, biased AWQ / dense (biases, clamped SwiGLU) and GGUF (Q8_0, Q4_K with
Q6_K down projections) run their expert GEMMs from persistent buffers, with no host read and no allocation, so a
capture (the CPU recording stand-in, tests/graph_capture.py) replayed on new routing, new slot tables and new
activations gives what the format's eager ``forward`` gives on them: bitwise on the Triton kernels (interpreted:
the same launches over persistent buffers), close on the static torch form (every expert on every row, as the
plain formats' one). The exact-token invariant with the captured device part on whole models:
tests/test_device_graphs_models.py. ~25 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from graph_capture import TraceCapture
from test_biased_kernels import biased_awq_pool
from test_device_graphs import DevicePartGuard
from test_gguf_kernels import gguf_pool
from test_mxfp4 import mxfp4_pool
from test_scheduling_helpers import random_expert

from moeflow.kernels.formats import biased_expert_format, gguf_expert_format
from moeflow.kernels.pool import ExpertPool

E, S, T, K = 5, 4, 3, 2


class SameDeviceGuard(DevicePartGuard):
    """test_device_graphs' guard, letting ``.to(device)`` onto the tensor's own device through (a no-op: the GGUF
    reference dequantization's module constants, moeflow/quant/ggml.py, on the CPU; on a GPU that is a host
    copy the capture refuses, and the GPU computes GGUF experts with the Triton kernels)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and len(args) == 2 and isinstance(args[1], torch.device) and not kwargs:
            if args[1] == args[0].device:
                return func(*args)
        return super().__torch_function__(func, types, args, kwargs)

pytestmark = pytest.mark.usefixtures("one_thread")


def _gguf(gate_up: str, downs: tuple[str, ...], H: int, I: int, gen) -> ExpertPool:  # noqa: E741
    from gguf_block_helpers import random_gguf_expert

    fmt = gguf_expert_format(gate_up, downs, H, I, torch.float32)
    pool = ExpertPool.allocate(fmt, S, "cpu")
    for s in range(S):  # slots of either down type (Q4_K_M's layers differ)
        fmt.write(pool.buffer[s], random_gguf_expert(fmt, gen, gate_up, downs[s % len(downs)]))
    return pool


def _dense(gen) -> ExpertPool:
    fmt = biased_expert_format(32, 64, "dense", torch.float32, None, activation="clamped_swiglu")
    pool = ExpertPool.allocate(fmt, S, "cpu")
    for s in range(S):
        fmt.write(pool.buffer[s], random_expert(fmt, gen))
    return pool


POOLS = {
    "mxfp4": lambda gen: mxfp4_pool(64, 64, S, gen),
    "biased-awq": lambda gen: biased_awq_pool(64, 64, 32, S, gen)[0],
    "biased-dense": _dense,
    "gguf-q8_0": lambda gen: gguf_pool("Q8_0", "Q8_0", 64, 64, S, gen),
    "gguf-q4_k-q6_k": lambda gen: _gguf("Q4_K", ("Q6_K", "Q4_K"), 256, 256, gen),
}


def _inputs(H: int, gen: torch.Generator, n: int) -> list[tuple]:
    """n (x [T, H], ids int32 [T, k], weights fp32 [T, k], slot_of_expert int32 [E], mask bool [E])."""
    calls = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
        w = torch.softmax(torch.randn(T, K, generator=gen), -1)
        slots = torch.randint(0, S, (E,), generator=gen, dtype=torch.int32)
        mask = torch.rand(E, generator=gen) < 0.7
        mask[ids[0, 0]] = True  # at least one selected pair
        calls.append((torch.randn(T, H, generator=gen) * 0.5, ids, w, slots, mask))
    return calls


def _captured(pool: ExpertPool, backend: str, calls: list[tuple]) -> list[torch.Tensor]:
    """The format's captured_forward over fixed buffers: warm-up and capture on the first call, replays after."""
    H = pool.fmt.hidden_size
    x, ids, w = torch.zeros(T, H), torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K)
    slots, mask, out = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.bool), torch.zeros(T * K, H)
    buffers: dict[str, torch.Tensor] = {}

    def alloc(name, shape, dtype, device):
        if name not in buffers:
            buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buffers[name]

    forward = pool.fmt.captured_forward(pool, x, ids, w, slots, mask, out, backend, alloc)
    cap, replay, got = TraceCapture(), None, []
    for call in calls:
        for buf, value in zip((x, ids, w, slots, mask), call, strict=True):
            buf.copy_(value)
        out.fill_(7.0)  # rows of unselected pairs keep it
        if replay is None:
            forward()  # the warm-up: buffers made, kernels compiled outside the capture
            out.fill_(7.0)
            cap.begin()
            if backend == "torch":
                with SameDeviceGuard():
                    forward()
            else:  # the interpreter makes tensors of its own: the recorded piece shows the launcher's
                forward()
            replay = cap.end()
            made = [str(op[0]) for op in cap.pieces[-1] if any(f in str(op[0]) for f in ("empty", "zeros", "full"))]
            assert not made, f"the captured piece allocated: {made}"
        else:
            replay()
        got.append(out.clone())
    return got


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(POOLS))
def test_replayed_captured_forward_is_the_eager_forward(name, backend):
    gen = torch.Generator().manual_seed(3)
    pool = POOLS[name](gen)
    if backend == "triton" and name == "biased-dense":
        pytest.skip("biased dense experts have no Triton kernels: the static torch form runs (tested on 'torch')")
    assert pool.fmt.capture_unsupported(backend) is None
    calls = _inputs(pool.fmt.hidden_size, gen, 3)
    got = _captured(pool, backend, calls)
    for i, ((x, ids, w, slots, mask), g) in enumerate(zip(calls, got, strict=True)):
        want = pool.fmt.forward(x, ids, w, pool, slots, torch.full_like(g, 7.0), mask, backend)
        chosen = mask[ids.reshape(-1).long()]
        assert chosen.any() and torch.equal(g[~chosen], want[~chosen]), f"call {i}: unselected rows written"
        if backend == "triton":  # the same launches as the eager path: the same bits
            assert torch.equal(g, want), f"call {i}: {(g - want).abs().max()}"
        else:
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"call {i}: {m}")


def test_gguf_experts_on_the_native_cpu_kernels_are_not_captured():
    fmt = gguf_expert_format("Q8_0", "Q8_0", 64, 64, torch.float32)
    if fmt.cpu_unsupported() is not None:
        pytest.skip(fmt.cpu_unsupported())
    cpu = fmt.with_cpu_kernels()
    assert "native CPU kernels" in cpu.capture_unsupported("torch")
    assert fmt.capture_unsupported("torch") is None and cpu.capture_unsupported("triton") is None
