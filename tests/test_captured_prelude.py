"""An offloaded layer's routing and read-back staging captured in the decode step's piece before it
(moeflow/offload/prelude.py): with CUDA graphs the host only replays, records the read-back's event, waits,
schedules and replays the device part.

On the CPU the capture is the recording stand-in of tests/test_compile_cuda_graphs.py (:class:`TraceCapture`,
Triton launches recorded as ops and launched again at replay; ``TRITON_INTERPRET=1`` runs the kernels). The
model's dense part runs the torch kernels (fast); its expert backend is the offload backend on the Triton path
(the prelude's condition). Here: the tokens, the read count and the schedule's stats with the captured step
equal the eager run's (and the tokens the resident model's) for lru / static at few and many slots, with and
without early hits, and for ondemand / mixtral-offloading; the staged read-back (the GPU branch, CUDA's events
stood in for) gives the same; the eager work between the pieces loses the routing launch and the staging ops.
"""

from __future__ import annotations

import collections

import pytest
import torch
from test_compile_cuda_graphs import MODEL, PROMPT, TraceCapture
from test_cuda_paths_emulated import fake_cuda  # noqa: F401 (a fixture)
from test_early_hits import _schedule
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine import cuda_graphs
from moeflow.offload import create_expert_backend
from moeflow.offload.readback import ReadBack

NEW_TOKENS = 5


def _model(policy: str, slots: int, early: bool = False, staged: bool = False, preludes: bool = True):
    """The embedded model (torch kernels) with an offload backend on the Triton path."""
    model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch", offload=OffloadConfig(policy="lru"))
    old = model.experts
    backend = create_expert_backend(
        OffloadConfig(policy=policy, gpu_expert_slots=slots, early_hits=early), fmt=old.fmt,
        num_layers=old.num_layers, num_experts=old.num_experts, top_k=model.config.num_experts_per_tok, device="cpu",
        kernels_backend="triton", gates=[b.gate for b in model.model.moe_blocks], reserved_bytes=0,
        stats=model.stats, checkpoint_dir=MODEL, host_store=old.host)
    backend.finish_loading()
    if staged:  # the GPU branch: device staging, a copy into "pinned" memory, one event wait
        backend.readback = backend.prelude.readback = ReadBack("cpu", backend.num_experts, staged=True)
    backend.prelude.enabled = preludes
    model.use_backend(backend)
    return model


def _captured(model, factory=TraceCapture):
    graphs = model.capture_decode(capture_factory=factory)
    graphs.inner = model.model
    return graphs


@pytest.fixture(scope="module")
def prompt():
    ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch")
    words = ref.tokenizer.encode(PROMPT)
    ids = torch.tensor([words[:6], words[3:9]])
    want = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    ref.close()
    return ids, want


@pytest.fixture(scope="module")
def one_row(prompt):
    """The first row alone (one token per decode step: fewer expert groups to interpret)."""
    ids, want = prompt
    return ids[:1], want[:1]


def _run(model, ids):
    model.stats.reset()
    reads = model.experts.readback.blocking_reads
    tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    return tokens, model.experts.readback.blocking_reads - reads, _schedule(model.stats)


def _compare(prompt, policy: str, slots: int, early: bool, staged: bool = False) -> None:
    ids, resident = prompt
    eager = _model(policy, slots, early, staged)
    try:
        want, want_reads, want_stats = _run(eager, ids)
    finally:
        eager.close()
    model = _model(policy, slots, early, staged)
    graphs = _captured(model)
    try:
        got, reads, stats = _run(model, ids)
        calls = graphs.step.calls
        device = model.experts.device_graphs
    finally:
        model.close()
    label = f"{policy}, {slots} slots, early_hits={early}"
    assert graphs.refused is None and graphs.captures == 1, label
    assert all(c.prelude is not None for c in calls), f"{label}: a layer's prelude was not captured"
    assert device.refused == {} and device.replays > 0, label
    assert torch.equal(want, resident), f"{label}: eager differs from resident"
    assert torch.equal(got, want), f"{label}: the captured step's tokens differ from eager"
    layers = model.config.num_hidden_layers
    assert reads == want_reads == layers * NEW_TOKENS, label  # one blocking read per layer and pass
    assert stats == want_stats, label
    if early:
        assert stats[("decode", "hits")] > 0, label


# 32 experts: at 8 slots misses in most layers, at 20 mostly hits; each policy with and without early hits once
# (the interpreter runs every expert group: each case takes ~40 s on the 2-core CI machine)
# (lfu differs from lru only in its eviction order, which the prelude never sees)
@pytest.mark.parametrize(("policy", "slots", "early"), [("lru", 8, False), ("lru", 20, True), ("static", 20, False)])
def test_the_captured_prelude_gives_the_eager_tokens_reads_and_stats(one_row, policy, slots, early):
    _compare(one_row, policy, slots, early)


@pytest.mark.parametrize("policy", ["ondemand", "mixtral-offloading"])
def test_the_other_plain_policies_take_the_captured_prelude(one_row, policy):
    _compare(one_row, policy, 12, early=False)


def test_the_staged_read_back_from_the_captured_prelude(one_row, fake_cuda):  # noqa: F811
    """The GPU branch of the read-back (CUDA's events stood in for): the mask staged and copied in the piece, the
    event recorded and waited for eagerly; the same tokens, reads and stats."""
    _compare(one_row, "lru", 10, True, staged=True)
    assert any(e.synchronized for e in fake_cuda.events)  # collect waited on the read-back's event


def test_the_prelude_stays_eager_where_it_cannot_be_captured(prompt):
    """A predictor (it observes and proposes on the host) and the torch kernels: no prelude, the eager call at
    replay, the same tokens."""
    ids, resident = prompt
    model = _model("promoe", 12)
    graphs = _captured(model)
    try:
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        assert "predictor" in model.experts.prelude.refusal(ids, model.model.moe_blocks[0].kernel_routing)
    finally:
        model.close()
    assert graphs.captures == 1 and all(c.prelude is None for c in graphs.step.calls)
    assert torch.equal(got, resident)
    torch_model = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch",
                                                      offload=OffloadConfig(policy="lru", gpu_expert_slots=12))
    try:
        x = torch.zeros(1, torch_model.config.hidden_size)
        assert torch_model.experts.capture_prelude(0, x, torch.zeros(1, 8), None) is None
    finally:
        torch_model.close()


# ---------------------------------------------------------------------------------------------------------
# the eager work between the pieces, counted (as benchmarks/host/eager_launches.py counts a layer's)


class _Counter(TorchDispatchMode):
    """Triton launches by kernel and torch ops by name, run by the captured step outside the pieces' replays."""

    def __init__(self) -> None:
        super().__init__()
        self.c: collections.Counter = collections.Counter()
        self.replaying = 0
        self.in_step = 0

    def counts(self) -> bool:
        return self.in_step > 0 and not self.replaying

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counts():
            self.c[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _counting_capture(counter: _Counter):
    class CountingCapture(TraceCapture):
        def end(self):
            replay = super().end()

            def counted() -> None:
                counter.replaying += 1
                try:
                    replay()
                finally:
                    counter.replaying -= 1
            return counted
    return CountingCapture


def _eager_ops_per_layer(prompt, monkeypatch, preludes: bool) -> tuple[collections.Counter, torch.Tensor]:
    from triton.runtime.interpreter import InterpretedFunction

    ids, _ = prompt
    counter = _Counter()
    model = _model("lru", 32, staged=True, preludes=preludes)  # every expert in a slot: lru's all-hit decode
    graphs = _captured(model, _counting_capture(counter))
    real_run, real_step = InterpretedFunction.run, cuda_graphs.CapturedStep.run

    def launch(fn, *args, **kwargs):
        if counter.counts():
            counter.c[f"triton.{fn.fn.__name__}"] += 1
        counter.replaying += 1  # the interpreter's own ops stand for the kernel
        try:
            return real_run(fn, *args, **kwargs)
        finally:
            counter.replaying -= 1

    def step(self, experts, device_part=None):
        counter.in_step += 1
        try:
            return real_step(self, experts, device_part)
        finally:
            counter.in_step -= 1

    try:
        model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=[])  # captured, device part too
        with monkeypatch.context() as patch, counter:
            patch.setattr(InterpretedFunction, "run", launch)
            patch.setattr(cuda_graphs.CapturedStep, "run", step)
            got = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=[])
        layers = model.config.num_hidden_layers
    finally:
        model.close()
    steps = 2  # decode steps of the counted call
    assert graphs.captures == 1 and all(v % (steps * layers) == 0 for v in counter.c.values()), counter.c
    return collections.Counter({k: v // (steps * layers) for k, v in counter.c.items()}), got


def test_the_routing_launch_and_the_staging_ops_leave_the_eager_part(prompt, monkeypatch, fake_cuda):  # noqa: F811
    before, want = _eager_ops_per_layer(prompt, monkeypatch, preludes=False)
    after, got = _eager_ops_per_layer(prompt, monkeypatch, preludes=True)
    assert torch.equal(got, want)
    launches = {k: v for k, v in before.items() if k.startswith("triton.")}
    assert launches == {"triton._route_plan_kernel": 1}, before  # the routing: the only eager launch (all hits)
    assert not any(k.startswith("triton.") for k in after), after
    staging = ("aten.zero_", "aten.index_fill_", "aten.cat")
    assert all(before[k] == 1 for k in staging), before
    assert all(after[k] == 0 for k in (*staging, "aten.moeflow::route", "aten.route")), after
    assert before["aten.copy_"] - after["aten.copy_"] == 1  # the copy into the pinned buffer
    assert sum(after.values()) < sum(before.values())


def test_a_pass_with_padding_runs_the_eager_call_at_replay(prompt):
    """The prelude routed every row of the captured shape: in a pass whose tokens are not all real (a padded
    serving batch) the call at replay is the eager ``forward_logits``, which leaves the padding out."""
    from moeflow.moe.backend import StepInfo

    ids, _ = prompt
    model = _model("lru", 32)
    graphs = _captured(model)
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=[])
        backend, call = model.experts, graphs.step.calls[0]
        mask = torch.tensor([[True], [False]])
        backend.begin_step(StepInfo(ids[:, :1], torch.zeros_like(ids[:, :1]), mask, "decode"))
        args = (call.layer, call.x, call.router_logits, call.route, call.kernel_routing)
        got = backend.forward_prelude(call.prelude, *args).clone()
        want = backend.forward_logits(*args, False)[0]
    finally:
        model.close()
    assert call.prelude is not None and torch.equal(got, want) and not got[1].any()
