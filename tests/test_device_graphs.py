"""The offload backend's device part captured as graphs (issue 14 item 6; moeflow/offload/device_step.py).

With ``cuda_graphs=True`` the expert groups and the combine of every offloaded layer run from static buffers,
captured once per batch size and replayed for every layer. On the CPU the capture is the recording stand-in of
tests/test_compile_cuda_graphs.py (:class:`TraceCapture`: a piece is the list of aten ops it ran, replayed on
the same tensors; host reads and data-dependent shapes are refused). Here: the device part creates no tensor
and reads nothing back; replaying it for every layer gives bitwise what running it uncaptured gives; the greedy
tokens stay the resident model's for lru / finemoe / expertflow / ondemand (and hybrid CPU compute); refused
captures and batch sizes past the captured buckets run the old eager path, flagged. The same on a GPU with real
CUDA graphs and the race harness: tests/test_cuda_lane.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from graph_capture import TraceCapture, _Recorder
from scripted_transport import ScriptedTransport
from test_compile_cuda_graphs import MODEL, PROMPT, captured_model
from test_host_loop import FORBIDDEN as HOST_READS
from test_host_loop import HostSyncError
from test_kernels import make_pool, make_routing
from test_scheduling_helpers import DENSE, Synthetic
from torch.overrides import TorchFunctionMode

from moeflow import MoEOffloadedMixtral, OffloadConfig, kernels
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.kernels.experts.capturable import nibble_shifts, static_expert_forward
from moeflow.kernels.experts.reference import expert_forward_pool_reference, pool_weights
from moeflow.offload.device_step import DeviceGraphs

_T = torch.Tensor
# tensor creation: the device part reads and writes its persistent buffers only
FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.as_tensor, torch.arange, torch.empty_like,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.from_numpy, torch.empty_strided, _T.new_empty,
    _T.new_zeros, _T.new_ones, _T.new_full, _T.new_tensor,
}


class DevicePartGuard(TorchFunctionMode):
    """Raises on a host read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool``, ``nonzero``, ...) or a tensor
    created (``torch.empty``, ``torch.tensor``, ``new_zeros``, ...) inside the block; counts the torch calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise HostSyncError(f"the device part read a tensor back: {getattr(func, '__name__', func)}")
        if func in FACTORIES:
            raise HostSyncError(f"the device part created a tensor: {getattr(func, '__name__', func)}")
        if func is _T.to and any(isinstance(a, (str, torch.device)) for a in (*args[1:], *(kwargs or {}).values())):
            raise HostSyncError("the device part moved a tensor between devices")
        self.calls += 1
        return func(*args, **(kwargs or {}))


def guarded(monkeypatch) -> list[DevicePartGuard]:
    """Run every call of the device part's two pieces (warm-up, capture, uncaptured runs) under a guard."""
    guards: list[DevicePartGuard] = []
    real_compute, real_combine = DeviceGraphs._compute_fn, DeviceGraphs._combine_fn

    def wrap(make):
        def fn_of(self, bucket):
            fn = make(self, bucket)

            def run():
                guard = DevicePartGuard()
                guards.append(guard)
                with guard:
                    fn()
            return run
        return fn_of

    monkeypatch.setattr(DeviceGraphs, "_compute_fn", wrap(real_compute))
    monkeypatch.setattr(DeviceGraphs, "_combine_fn", wrap(real_combine))
    return guards


@pytest.mark.parametrize(("kind", "dtype"), [("awq", torch.float32), ("awq", torch.bfloat16),
                                           ("dense", torch.float32), ("dense", torch.float16)])
def test_the_static_torch_form_matches_the_reference(kind, dtype):
    """kernels/experts/capturable.py against the torch reference: the selected experts' rows close, the others
    untouched."""
    H, I, E, S, T, k = 64, 96, 6, 5, 7, 2  # noqa: E741
    pool = make_pool(H, I, S, 32 if kind == "awq" else None, dtype, kind=kind)
    ids, weights = make_routing(T, k, E, seed=3)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(4)) * 0.5).to(dtype)
    slot_of_expert = torch.tensor([3, 0, 4, 1, 2, 0], dtype=torch.int32)
    mask = torch.tensor([True, False, True, True, False, True])
    sentinel = torch.full((T * k, H), 7.0, dtype=dtype)
    want = expert_forward_pool_reference(x, ids, weights, *pool_weights(pool)[:2], slot_of_expert, mask,
                                         pool.fmt.group_size or 0, sentinel.clone())
    got = static_expert_forward(x, ids, weights, pool, slot_of_expert, mask, sentinel.clone(), nibble_shifts(x.device))
    chosen = mask[ids.reshape(-1).long()]
    assert torch.equal(got[~chosen], sentinel[~chosen]) and chosen.any() and (~chosen).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[chosen].float(), want[chosen].float(), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def prompt_ids():
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)] * 2)
    want = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
    ref.close()
    return ids, want


def _layer_inputs(backend, T: int, layers: int, seed: int = 0) -> list[tuple]:
    """Random (x [T, H], probs fp32 [T, E], ids int32 [T, k], weights fp32 [T, k]) for each layer."""
    gen = torch.Generator().manual_seed(seed)
    H, E, k = backend.fmt.hidden_size, backend.num_experts, backend.top_k
    calls = []
    for _ in range(layers):
        x = torch.randn(T, H, generator=gen)
        probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
        w, ids = probs.topk(k, dim=-1)
        calls.append((x, probs, ids.to(torch.int32), w / w.sum(-1, keepdim=True)))
    return calls


def _offloaded(slots: int = 20, **config) -> MoEOffloadedMixtral:
    return MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch",
                                               offload=OffloadConfig(policy="lru", gpu_expert_slots=slots, **config))


def test_the_device_part_creates_no_tensor_and_reads_nothing_back(monkeypatch):
    guards = guarded(monkeypatch)
    model = _offloaded()
    backend = model.experts
    try:
        graphs = backend.enable_device_graphs(TraceCapture)
        calls = _layer_inputs(backend, 2, backend.num_layers * 3)
        with graphs.region():
            for i, (x, probs, ids, w) in enumerate(calls):
                backend.forward(i % backend.num_layers, x, probs, ids, w)
        graphs.capture_enabled = False  # every group and combine now runs the pieces' Python, under the guard
        with graphs.region():
            for i, (x, probs, ids, w) in enumerate(calls):
                backend.forward(i % backend.num_layers, x, probs, ids, w)
    finally:
        model.close()
    assert graphs.refused == {} and graphs.captures == 1 and graphs.replays > 0
    assert len(guards) > 2 * len(calls) and all(g.calls > 0 for g in guards)  # the guard saw the work


def test_the_guard_catches_a_host_read():
    """The guard above is not blind: a ``.item()`` or a new tensor inside it raises."""
    t = torch.ones(2)
    with pytest.raises(HostSyncError, match="read a tensor back"), DevicePartGuard():
        t.sum().item()
    with pytest.raises(HostSyncError, match="created a tensor"), DevicePartGuard():
        t.new_zeros(3)


def test_replaying_the_device_part_for_every_layer_is_bitwise_the_uncaptured_run():
    model = _offloaded(slots=12)  # 12 of 32 experts: misses and loads in most layers (several groups a layer)
    backend = model.experts
    try:
        graphs = backend.enable_device_graphs(TraceCapture)
        calls = _layer_inputs(backend, 2, backend.num_layers * 4, seed=1)
        eager = [backend.forward(i % backend.num_layers, *c).clone() for i, c in enumerate(calls)]
        with graphs.region():
            replayed = [backend.forward(i % backend.num_layers, *c).clone() for i, c in enumerate(calls)]
        replays = graphs.replays
        graphs.capture_enabled = False
        with graphs.region():
            uncaptured = [backend.forward(i % backend.num_layers, *c).clone() for i, c in enumerate(calls)]
        misses = model.stats.prefill.misses + model.stats.decode.misses
    finally:
        model.close()
    assert graphs.captures == 1 and replays > len(calls) and misses > 0  # more than one group in some layers
    for i, (a, b) in enumerate(zip(replayed, uncaptured, strict=True)):
        assert torch.equal(a, b), f"layer call {i}: the replayed device part differs from the uncaptured one"
    for a, b in zip(replayed, eager, strict=True):  # the static torch form: close to the eager reference
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


POLICY_CONFIGS = {
    "lru": dict(policy="lru", gpu_expert_slots=14),
    "ondemand": dict(policy="ondemand", gpu_expert_slots=8),
    "finemoe": dict(policy="finemoe", gpu_expert_slots=16),
    "expertflow": dict(policy="expertflow", gpu_expert_slots=16),
    "lru-random-delay": dict(policy="lru", gpu_expert_slots=10, transport="random-delay", random_delay_ms=0.3, seed=3),
}


@pytest.mark.parametrize("name", list(POLICY_CONFIGS))
def test_exact_tokens_with_the_captured_device_part(prompt_ids, name):
    ids, want = prompt_ids
    # plain step inputs (FineMoE's semantic search reads the step's embeddings on the host, in begin_step)
    model, graphs = captured_model(OffloadConfig(**POLICY_CONFIGS[name]), inner=lambda decoder: decoder)
    try:
        got = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
        again = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
        device = model.experts.device_graphs
    finally:
        model.close()
    assert graphs.refused is None
    assert device.disabled is None and device.refused == {}, (device.disabled, device.refused)
    assert device.captures == 1 and device.replays > 2 * 9 * model.config.num_hidden_layers
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
@pytest.mark.parametrize("mode", ["always", "auto"])
def test_hybrid_cpu_experts_with_the_captured_device_part(prompt_ids, mode):
    """Misses computed on the CPU are written into the static ``out`` before the combine's replay: the tokens
    are those of the same hybrid configuration run eagerly."""
    ids, _ = prompt_ids
    config = dict(policy="lru", gpu_expert_slots=6, cpu_compute=mode)
    if mode == "auto":
        config.update(h2d_gbps=0.04, cpu_expert_ms=0.9, cpu_token_ms=0.5)  # tests/hybrid_helpers.AUTO_RATES
    eager = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=OffloadConfig(**config))
    try:
        want = eager.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    finally:
        eager.close()
    model, _ = captured_model(OffloadConfig(**config), inner=lambda decoder: decoder)
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
        device, stats = model.experts.device_graphs, model.stats
    finally:
        model.close()
    assert device.refused == {} and device.captures == 1 and device.replays > 0
    assert stats.decode.cpu_experts + stats.decode.cpu_races > 0  # CPU work in decode (races, for "auto")
    assert torch.equal(got, want)


class RefusingWhere(TraceCapture):
    """A capture that refuses ``where`` (as a device refuses a syncing op): the device part cannot be captured."""

    def begin(self) -> None:
        super().begin()
        self._mode.refuse = True


def test_a_refused_capture_runs_the_layer_eagerly_flagged(prompt_ids, monkeypatch, caplog):
    ids, want = prompt_ids
    real = _Recorder.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        if getattr(self, "refuse", False) and func is torch.ops.aten.where.self:
            raise HostSyncError(f"{func} while capturing: refused")
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(_Recorder, "__torch_dispatch__", dispatch)
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch",
                                                offload=OffloadConfig(policy="lru", gpu_expert_slots=14))
    decode = model.capture_decode(capture_factory=TraceCapture)
    model.experts.enable_device_graphs(RefusingWhere)  # made once: the step's own factory is not used again
    del decode
    try:
        with caplog.at_level(logging.WARNING, logger="moeflow.offload.device_step"):
            got = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[])
        device = model.experts.device_graphs
    finally:
        model.close()
    assert "aten.where" in device.refused[2] and device.captures == 0 and device.eager_layers > 0
    assert "device part for batch size 2 runs eagerly" in caplog.text
    assert torch.equal(got, want)


def test_batch_sizes_past_the_captured_buckets_run_eagerly():
    model = _offloaded()
    backend = model.experts
    try:
        graphs = backend.enable_device_graphs(TraceCapture)
        graphs.max_buckets = 1
        with graphs.region():
            two = [backend.forward(i, *c).clone() for i, c in enumerate(_layer_inputs(backend, 2, 4))]
            three = [backend.forward(i, *c).clone() for i, c in enumerate(_layer_inputs(backend, 3, 4, seed=2))]
        eager = [backend.forward(i, *c).clone() for i, c in enumerate(_layer_inputs(backend, 3, 4, seed=2))]
    finally:
        model.close()
    assert list(graphs.buckets) == [2] and "not a captured bucket" in graphs.refused[3]
    assert graphs.eager_layers == 4 and all(t.shape == (2, backend.fmt.hidden_size) for t in two)
    assert all(torch.equal(a, b) for a, b in zip(three, eager, strict=True))  # the old eager path, exactly


@pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
def test_a_backend_without_a_capturable_device_part_stays_eager(caplog):
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="cpu-int4",
                                                offload=OffloadConfig(policy="lru", gpu_expert_slots=14))
    try:
        with caplog.at_level(logging.WARNING, logger="moeflow.offload.device_step"):
            graphs = model.experts.enable_device_graphs(TraceCapture)
        with graphs.region():
            x, _, ids, w = _layer_inputs(model.experts, 2, 1)[0]
            assert graphs.begin_layer(x, ids, w) is None
    finally:
        model.close()
    assert "cpu-int4" in graphs.disabled and "runs eagerly" in caplog.text


# ---------------------------------------------------------------------------------------------------------
# ordering: the replays under the scripted transport (tests/scripted_transport.py: compute deferred on an emulated
# stream, copies landed as late or as early as their fences allow, a violated order poisons the slot)


def _scripted_graph_run(s: Synthetic, transport: ScriptedTransport, **config) -> tuple[list, DeviceGraphs]:
    backend, stats = s.offloaded(transport_object=transport, **config)
    graphs = backend.enable_device_graphs(TraceCapture)
    try:
        with transport.deferring_compute(kernels), graphs.region():
            got = s.run(backend, stats)  # each output a queued copy of the static y
            backend.synchronize()
    finally:
        backend.close()
    return got, graphs


@pytest.fixture(scope="module")
def synth_uncaptured():
    """A dense trace and its outputs from the same device part (the static torch form), uncaptured and synchronous."""
    s = Synthetic(DENSE, layers=3, experts=6, top_k=2, seed=11, steps=6, prefill_tokens=9)
    backend, stats = s.offloaded(policy="lru", gpu_expert_slots=s.L * s.E)
    graphs = backend.enable_device_graphs(TraceCapture)
    graphs.capture_enabled = False
    expected = []
    with graphs.region():
        for phase, layer, x, probs, ids, w in s.calls():
            stats.set_phase(phase)
            expected.append(backend.forward(layer, x, probs, ids, w).clone())
    backend.close()
    return s, expected


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_the_fences_order_the_replayed_device_part(synth_uncaptured, mode):
    """Every group's replay waits (on the emulated stream) for its loads, and every copy into a slot waits for the
    queued replay that reads it: no hazard, and bitwise the uncaptured outputs, with slots reused within and
    across layers."""
    s, expected = synth_uncaptured
    for policy in ("lru", "ondemand", "mixtral-offloading"):
        for n_slots in (2, 3, 5):
            transport = ScriptedTransport(mode)
            got, graphs = _scripted_graph_run(s, transport, policy=policy, gpu_expert_slots=n_slots)
            label = f"{policy} with {n_slots} slots, mode={mode}"
            assert transport.hazards == [], f"{label}: {transport.hazards[:3]}"
            assert graphs.refused == {} and graphs.captures == 2 and graphs.replays > len(expected), label
            for i, (a, b) in enumerate(zip(expected, got, strict=True)):
                assert torch.equal(a, b), f"{label}: layer call {i} differs"


def test_a_replay_not_ordered_after_its_loads_is_caught(synth_uncaptured):
    """The check above is not blind: with the compute stream's wait for the copies deleted, replays read slots
    whose copies have not landed."""
    s, expected = synth_uncaptured
    transport = ScriptedTransport("late")
    transport.wait_compute = lambda handles: 0.0
    got, _ = _scripted_graph_run(s, transport, policy="lru", gpu_expert_slots=2)
    wrong = sum(not torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert transport.hazards and wrong > 0
