"""The fused kernels as the model uses them (TRITON_INTERPRET=1): on the Triton path a MoE layer's plain softmax
top-k router runs inside the plan launch, so a decode step launches at most 4 Triton kernels per MoE layer
(route + plan, w13, w2, combine with the split-K sum); the tokens are those of the unfused path, and the
offloaded backend, which routes with the same kernel, keeps the resident tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import make_tiny_checkpoint
from test_kernels import make_pool
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import MoEOffloadedMixtral, OffloadConfig, kernels
from moeflow.families.layers import AWQLinear
from moeflow.moe import MoEBlock, ResidentExperts, RouterSpec
from moeflow.tools.quantize import quantize_checkpoint

MAX_DECODE_LAUNCHES = 4  # issue 15 item 4: Triton launches per MoE layer at decode
# aten ops that launch no device kernel (metadata, allocation); any other op outside a Triton launch is a kernel
NO_KERNEL = {"view", "_unsafe_view", "reshape", "t", "slice", "select", "unsqueeze", "squeeze", "expand", "detach",
             "alias", "as_strided", "new_empty", "empty", "empty_strided", "set_", "lift_fresh"}
ROUTER_GEMM = {"mm", "addmm", "linear"}  # the block's router linear (cuBLAS on a GPU), outside the expert kernels


class _Launches(TorchDispatchMode):
    """Device launches: ``triton`` (kernel names, from the interpreter) and ``aten`` (compute ops outside them)."""

    def __init__(self) -> None:
        super().__init__()
        self.triton: list[str] = []
        self.aten: list[str] = []
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and name not in NO_KERNEL:
            self.aten.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_launches():
    """Count Triton launches (the interpreter's entry) and the aten kernels run between them."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    mode = _Launches()

    def counting(fn, *args, **kwargs):
        mode.triton.append(fn.fn.__name__)
        mode._inside += 1  # the interpreter's own tensor ops are part of the launch
        try:
            return run(fn, *args, **kwargs)
        finally:
            mode._inside -= 1

    InterpretedFunction.run = counting
    try:
        with mode:
            yield mode
    finally:
        InterpretedFunction.run = run


@pytest.fixture(autouse=True)
def _no_value_checks(monkeypatch):
    # the CPU-only value checks of the kernels' arguments (skipped on a GPU) are not launches to count
    monkeypatch.setenv("MOEFLOW_KERNEL_CHECKS", "0")


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("wired")
    src = make_tiny_checkpoint(d / "fp32", seed=4, num_hidden_layers=2, hidden_size=64, intermediate_size=64,
                               num_local_experts=4, num_experts_per_tok=2)
    return quantize_checkpoint(src, d / "awq", group_size=32, quantize_attention=True, progress=False)


def _prompt() -> torch.Tensor:
    return torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))


def test_decode_is_at_most_four_launches_per_moe_layer(awq_checkpoint):
    model = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="triton")
    assert isinstance(model.experts, ResidentExperts)
    blocks = [m for m in model.model.modules() if isinstance(m, MoEBlock)]
    calls: list[tuple[int, list[str], list[str]]] = []  # per MoE call: (tokens per row, Triton, other kernels)
    with _count_launches() as launches:
        start = [0, 0]

        def opened(mod, args):
            start[:] = [len(launches.triton), len(launches.aten)]

        def closed(mod, args, out):
            calls.append((args[0].shape[-2], launches.triton[start[0]:], launches.aten[start[1]:]))

        for block in blocks:
            block.register_forward_pre_hook(opened)
            block.register_forward_hook(closed)
        model.generate(_prompt(), max_new_tokens=3, eos_token_id=[])
    # the AWQ attention projections were packed once at load: the expert kernel runs them, never the published-
    # layout kernel that gathers zeros and scales per element
    awq = [m for m in model.model.modules() if isinstance(m, AWQLinear)]
    assert awq and all(m.packed for m in awq)
    assert "_awq_linear_kernel" not in launches.triton and "_expert_gemm_kernel" in launches.triton
    decode = [c for c in calls if c[0] == 1]
    assert len(decode) == 2 * len(blocks) and len(calls) == 3 * len(blocks)  # prefill + two decode steps
    for _, triton_kernels, others in decode:
        assert len(triton_kernels) <= MAX_DECODE_LAUNCHES, triton_kernels
        assert triton_kernels[0] == "_route_plan_kernel" and triton_kernels[-1] == "_combine_kernel", triton_kernels
        assert len(others) == 1 and others[0] in ROUTER_GEMM, others  # no torch softmax / top-k / copies


def test_fused_routing_gives_the_unfused_tokens_and_the_offloaded_ones(awq_checkpoint):
    ids = _prompt()
    fused = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="triton")
    want = fused.generate(ids, max_new_tokens=5, eos_token_id=[])
    unfused = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="triton")
    for block in unfused.model.modules():
        if isinstance(block, MoEBlock):
            block.kernel_routing = None  # the block's torch router, then moe_forward on the ids
    assert torch.equal(unfused.generate(ids, max_new_tokens=5, eos_token_id=[]), want)
    torch_ref = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="torch")
    assert torch.equal(torch_ref.generate(ids, max_new_tokens=5, eos_token_id=[]), want)
    for slots in (2, 5):  # the offloaded backend routes with the same Triton kernel: the resident tokens
        off = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="triton",
                                                  offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        try:
            assert torch.equal(off.generate(ids, max_new_tokens=5, eos_token_id=[]), want), slots
        finally:
            off.experts.close()


@pytest.mark.parametrize("renormalize", [True, False])
def test_block_fuses_plain_routers_bitwise_like_the_route_kernel(renormalize):
    """The fused plan's routing == kernels.route's (the offloaded path's) bit for bit; outputs match the torch
    router's path; the block records the same ids either way."""
    from moeflow.moe import RoutingRecorder

    H, I, E, k, T = 64, 64, 6, 2, 3  # noqa: E741
    pool = make_pool(H, I, E, 32, torch.float32, seed=7)
    experts = ResidentExperts(pool.fmt, 1, E, "cpu", kernels_backend="triton")
    experts.pool = pool
    block = MoEBlock(H, E, RouterSpec(top_k=k, renormalize=renormalize), 0, torch.float32)
    torch.nn.init.normal_(block.gate.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2))
    assert block.kernel_routing is not None
    with _count_launches() as launches:
        block(x, experts)
    assert launches.triton[0] == "_route_plan_kernel" and len(launches.triton) <= MAX_DECODE_LAUNCHES
    assert launches.aten == ["mm"], launches.aten
    rec = RoutingRecorder(1)
    fused = block(x, experts, rec)
    logits = block.gate(x[0])
    ids, w = kernels.route(logits, k, "triton", renormalize=renormalize)
    y, got_ids, got_w = kernels.moe_forward(x[0], None, None, pool, experts.slot_tables[0], "triton",
                                            router_logits=logits, top_k=k, renormalize=renormalize,
                                            return_routing=True)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w) and torch.equal(y, fused[0])
    assert torch.equal(rec.topk_ids[0], ids.view(1, T, k))
    block.kernel_routing = None
    rec2 = RoutingRecorder(1)
    with _count_launches() as launches:
        unfused = block(x, experts, rec2)
    assert {"_softmax", "topk"} <= set(launches.aten)  # the counter sees the torch router
    torch.testing.assert_close(unfused, fused, rtol=1e-5, atol=1e-6)
    assert torch.equal(rec2.topk_ids[0], rec.topk_ids[0])


@pytest.mark.parametrize("spec", [RouterSpec(top_k=2, scoring="sigmoid", selection_bias=True, n_groups=2,
                                             topk_groups=1, renormalize=True),
                                  RouterSpec(top_k=2, scaling_factor=2.5),
                                  RouterSpec(top_k=2, topk_before_scoring=True)])
def test_grouped_biased_and_scaled_routers_stay_in_torch(spec):
    block = MoEBlock(64, 4, spec, 0, torch.float32)
    assert block.kernel_routing is None
