"""Issue 14: one blocking device->host read per MoE layer per decode step, for every policy.

The layer's inputs are given as :class:`DeviceTensor`, a tensor subclass that stands for device memory: every
host conversion (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``.numpy()``) and every op whose output
shape depends on the values (``bincount``, ``nonzero``, ``unique``, ``masked_select``, boolean indexing: on CUDA
they read back behind the caller's back) raises, and the subclass propagates through every op computed from
those inputs (the predictors' networks included). The only way to the host is the backend's
:class:`~moeflow.offload.readback.ReadBack`, whose reads are counted: exactly one per layer.
Expert compute goes through the Platform seam as a no-op (the kernels are another issue's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from graph_capture import HostSyncError
from torch.utils._python_dispatch import TorchDispatchMode

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.moe.backend import StepInfo
from moeflow.offload import POLICY_NAMES, create_expert_backend
from moeflow.offload.cpu_slots import CpuInt4Format
from moeflow.offload.platform import Platform
from moeflow.offload.readback import ReadBack

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
# resident has no scheduler; fiddler computes on the CPU by design (hybrid execution reads x back)
POLICIES = [p for p in POLICY_NAMES if p not in ("resident", "fiddler")]


_T = torch.Tensor
FORBIDDEN = {
    _T.tolist, _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.numpy, _T.cpu, _T.__array__,
    torch.bincount, _T.bincount, torch.nonzero, _T.nonzero, torch.unique, _T.unique, torch.masked_select,
    _T.masked_select, torch.argwhere, _T.argwhere, torch.unique_consecutive,
}


class DeviceTensor(torch.Tensor):
    """Device memory stand-in: host reads raise (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in FORBIDDEN:
            raise HostSyncError(f"host read of a device tensor outside the layer's read-back: {func.__name__}")
        if func is _T.__getitem__ and _has_bool_index(args[1]):
            raise HostSyncError("boolean-mask indexing of a device tensor (a data-dependent shape)")
        if func in (torch.repeat_interleave, _T.repeat_interleave) and "output_size" not in (kwargs or {}):
            raise HostSyncError("repeat_interleave without output_size (reads the repeats back)")
        return super().__torch_function__(func, types, args, kwargs or {})


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _noop(layer, topk_ids, experts) -> None:
    """Expert compute through the Platform seam: nothing."""


@pytest.fixture(scope="module")
def model():
    m = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=OffloadConfig(policy="lru"))
    yield m
    m.close()


def _backend(model, policy: str, slots: int):
    old = model.experts
    backend = create_expert_backend(
        OffloadConfig(policy=policy, gpu_expert_slots=slots), fmt=old.fmt, num_layers=old.num_layers,
        num_experts=old.num_experts, top_k=model.config.num_experts_per_tok, device="cpu", kernels_backend="torch",
        gates=[b.gate for b in model.model.moe_blocks], reserved_bytes=0, stats=model.stats,
        checkpoint_dir=MODEL, host_store=old.host, platform=Platform(compute=_noop),
    )
    backend.finish_loading()
    return backend


def test_device_tensor_catches_host_reads():
    t = torch.arange(4).as_subclass(DeviceTensor)
    for read in (lambda: t.tolist(), lambda: int(t[0]), lambda: torch.bincount(t), lambda: t[t > 1],
                 lambda: bool(t.any()), lambda: t.cpu()):
        with pytest.raises(HostSyncError):
            read()
    assert isinstance(torch.topk(t.float() * 2, 2).indices, DeviceTensor)  # propagates through ops


def test_readback_one_read_returns_mask_and_proposals():
    rb = ReadBack("cpu", num_experts=6, capacity=4)  # grows past its capacity
    top = torch.tensor([[4, 1], [1, 0]], dtype=torch.int32).as_subclass(DeviceTensor)
    props = torch.tensor([3, 5, -1]).as_subclass(DeviceTensor)
    probs = torch.rand(2, 6).as_subclass(DeviceTensor)
    needed, lists, floats = rb.read(top, [props, top], [probs])
    assert needed == [0, 1, 4] and lists == [[3, 5, -1], [4, 1, 1, 0]] and rb.blocking_reads == 1
    assert torch.equal(floats[0], probs.as_subclass(torch.Tensor)) and type(floats[0]) is torch.Tensor
    needed, _, _ = rb.read(torch.tensor([[2, 2]]), [])
    assert needed == [2] and rb.blocking_reads == 2  # the mask is cleared between reads


@pytest.mark.parametrize("slots", [32, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_blocking_read_per_layer(model, policy, slots):
    backend = _backend(model, policy, slots)
    L, E, k, H = backend.num_layers, backend.num_experts, backend.top_k, model.config.hidden_size
    gen = torch.Generator().manual_seed(slots)
    history = torch.tensor([model.tokenizer.encode("The \"with\" statement is used to wrap the execution")])
    model.stats.reset()
    model.stats.set_phase("decode")
    steps = 4
    try:
        for step in range(steps):
            n = history.shape[1] - steps + step
            ids = history[:, n - 1 : n]
            backend.begin_step(StepInfo(ids, torch.tensor([[n - 1]]), torch.ones_like(ids, dtype=torch.bool),
                                        "decode", None, torch.randn(1, 1, H, generator=gen), history[:, :n],
                                        torch.ones(1, n, dtype=torch.bool)))
            for layer in range(L):
                x = torch.randn(1, H, generator=gen)
                probs = torch.softmax(torch.randn(1, E, generator=gen), -1)
                top = torch.randperm(E, generator=gen)[:k].view(1, k).to(torch.int32)
                w = probs.gather(1, top.long())
                before = backend.readback.blocking_reads
                backend.forward(layer, *(t.as_subclass(DeviceTensor) for t in (x, probs, top, w / w.sum())))
                assert backend.readback.blocking_reads == before + 1, (policy, layer)
        d = model.stats.decode
        assert d.hits + d.misses == steps * L * k
        backend.cache.check()
    finally:
        backend.close()


class _CustomOpCalls(TorchDispatchMode):
    """Records every op of the ``moeflow`` torch.library namespace dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "moeflow":
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_decode_makes_no_custom_op_call(model, policy):
    """The dispatch tax: the scheduler's eager path (read-back, plan, predictors, the combine) calls plain torch,
    never a ``torch.ops.moeflow`` custom op (those stay for torch.compile); expert kernels are a no-op here."""
    backend = _backend(model, policy, 16)
    L, E, k, H = backend.num_layers, backend.num_experts, backend.top_k, model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    history = torch.tensor([model.tokenizer.encode("The quick brown fox jumps over the lazy dog")])
    model.stats.reset()
    model.stats.set_phase("decode")
    try:
        with _CustomOpCalls() as seen:
            for step in range(3):
                n = history.shape[1] - 3 + step
                ids = history[:, n - 1 : n]
                backend.begin_step(StepInfo(ids, torch.tensor([[n - 1]]), torch.ones_like(ids, dtype=torch.bool),
                                            "decode", None, torch.randn(1, 1, H, generator=gen), history[:, :n],
                                            torch.ones(1, n, dtype=torch.bool)))
                for layer in range(L):
                    probs = torch.softmax(torch.randn(1, E, generator=gen), -1)
                    top = torch.topk(probs, k).indices.to(torch.int32)
                    w = probs.gather(1, top.long())
                    backend.forward(layer, torch.randn(1, H, generator=gen), probs, top, w / w.sum(-1, keepdim=True))
    finally:
        backend.close()
    assert seen.calls == [], f"{policy}: custom ops dispatched in eager decode: {sorted(set(seen.calls))}"


@pytest.mark.parametrize(("policy", "slots", "transport"), [
    ("lru", 32, "sync"), ("lru", 16, "random-delay"), ("lru", 2, "sync"), ("finemoe", 8, "random-delay"),
    ("duoserve", 4, "sync"), ("mixtral-offloading", 8, "random-delay"),
])
def test_cpu_int4_slots_give_the_resident_cpu_int4_tokens(policy, slots, transport):
    """kernels="cpu-int4" with an offloading policy: the slots hold torch's int4 form (copied from the host
    store as is) and compute it in place, bitwise the resident CPU int4 path's tokens."""
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="cpu-int4")
    ids = torch.tensor([ref.tokenizer.encode("The \"with\" statement is used to wrap the execution")])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    m = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="cpu-int4", offload=OffloadConfig(
        policy=policy, gpu_expert_slots=slots, transport=transport, random_delay_ms=0.3))
    try:
        got = m.generate(ids, max_new_tokens=12, do_sample=False)
        backend = m.experts
    finally:
        m.close()
    assert torch.equal(got, want)
    # the slots hold the int4 form and each slot's form reads the slot's own bytes: nothing converted on a miss
    assert isinstance(backend.fmt, CpuInt4Format) and backend.host.fmt == backend.fmt
    for slot, form in enumerate(backend.int4_slots.forms):
        assert form.w13.packed.data_ptr() == backend.pool.buffer[slot].data_ptr(), slot

