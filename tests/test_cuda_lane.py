"""The CUDA lane (issue 12), run on a lent GPU with the kernels compiled, not interpreted:

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_lane.py tests/test_invariant.py

1. the Triton kernels at Mixtral-8x7B shapes against the fp32 torch reference (fused route + plan included), and
   the MXFP4 kernels at gpt-oss-120b expert shapes in bf16 (a path the interpreter never runs);
2. the race harness (tests/race_transport.py): evicted slots poisoned with NaN on the copy stream and every chunk
   delayed, each layer's MoE output bitwise the resident backend's, for the caching policies at 3 slot budgets;
   and, with one ``wait_event`` deleted, the harness must catch the race (else it proves nothing);
3. every policy's greedy tokens equal resident on real streams, at 3 slot budgets (fiddler, whose CPU experts run
   in bf16, is checked to a margin by tests/test_claims.py instead);
4. the offload backend's device part captured as CUDA graphs: the race harness again (bitwise resident, and a
   deleted wait caught) with every expert group and combine replayed, and ``cuda_graphs=True`` decoding with it
   (lru / ondemand / finemoe / expertflow, Triton and the torch static form) gives the resident tokens;
5. the split-K fixup (the last program of a tile sums the splits, ``triton_experts``) with real concurrency: w13
   split 2 / 4 / 8 at Mixtral shapes, bitwise the same over many launches and CUDA-graph replays, close to the
   reference, counters back at zero (the interpreter runs programs one at a time: it cannot show a visibility race).

Skipped without CUDA, and under the interpreter (conftest sets TRITON_INTERPRET=1 unless it is set already).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: the lane checks the compiled kernels"),
]

MIXTRAL = (4096, 14336, 8, 2, 128)  # hidden, intermediate, experts, top_k, group
GPT_OSS_120B = (2880, 2880, 128, 4)  # hidden, intermediate, experts, top_k (MXFP4 experts, group 32)
CACHING_POLICIES = ("ondemand", "lru", "mixtral-offloading")


# ---------------------------------------------------------------------------------------------------------
# 1. compiled kernels at Mixtral shapes


@pytest.fixture(scope="module")
def mixtral_pool():
    H, I, E, _, g = MIXTRAL  # noqa: E741
    return _pool_on_cuda(H, I, E, g)


def _pool_on_cuda(H, I, E, g):  # noqa: E741
    """E random AWQ experts (random nibbles and zero points, scales ~0.01) in a bf16 pool on the GPU."""
    from test_scheduling_helpers import random_expert

    from moeflow.kernels.formats import expert_format
    from moeflow.kernels.pool import ExpertPool

    fmt = expert_format(H, I, "awq", torch.bfloat16, g)
    pool = ExpertPool.allocate(fmt, E, "cuda")
    gen = torch.Generator().manual_seed(0)
    for e in range(E):
        fmt.write(pool.buffer[e], {k: v.cuda() for k, v in random_expert(fmt, gen).items()})
    return pool


@pytest.mark.parametrize("T", [1, 2, 4, 16, 64, 512])
def test_compiled_moe_forward_at_mixtral_shapes(mixtral_pool, T):
    from test_kernels import assert_close

    from moeflow import kernels
    from moeflow.kernels.experts.reference import combine_reference, expert_forward_reference, route_reference

    H, I, E, k, _ = MIXTRAL  # noqa: E741
    pool = mixtral_pool
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=gen)
    slot = torch.arange(E, dtype=torch.int32, device="cuda")
    y, ids, w = kernels.moe_forward(x, None, None, pool, slot, "triton", router_logits=logits, top_k=k,
                                    return_routing=True)
    ref_ids, ref_w = route_reference(logits, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    r_ids, r_w = kernels.route(logits, k, "triton")  # the offloaded path's router: bitwise the fused plan's
    assert torch.equal(r_ids, ids) and torch.equal(r_w, w)
    out = torch.empty(T * k, H, dtype=x.dtype, device="cuda")
    ref = combine_reference(expert_forward_reference(x, ids, w, pool, slot, out), k)
    assert_close(y, ref, torch.bfloat16)
    torch.cuda.synchronize()


def test_compiled_packed_awq_linear_at_attention_shape():
    from test_kernels import assert_close

    from moeflow import kernels
    from moeflow.quant.awq import quantize_rtn

    K = N = 4096
    q = quantize_rtn(torch.randn(N, K) / K**0.5, 128)
    packed = {n: t.cuda() for n, t in kernels.pack_awq_linear(q.qweight, q.qzeros, q.scales.bfloat16()).items()}
    for M in (1, 4, 64, 512):
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = kernels.awq_linear(x, q.qweight.cuda(), q.qzeros.cuda(), q.scales.bfloat16().cuda(), 128, "torch")
        got = kernels.awq_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], 128, "triton", packed=True)
        assert_close(got, ref, torch.bfloat16)


@pytest.fixture(scope="module")
def gpt_oss_pool():
    """16 random gpt-oss-120b-shaped MXFP4 experts (bf16 biases, clamped SwiGLU) in a pool on the GPU."""
    from test_mxfp4 import mxfp4_pool

    from moeflow.kernels.pool import ExpertPool

    H, I, _, _ = GPT_OSS_120B  # noqa: E741
    pool = mxfp4_pool(H, I, 16, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    return ExpertPool(pool.fmt, pool.buffer.cuda())


@pytest.mark.parametrize("T", [1, 4, 16, 64, 512])
def test_compiled_mxfp4_experts_at_gpt_oss_shapes(gpt_oss_pool, T):
    """The bf16 MMA path of the MXFP4 kernels (the interpreter runs bf16 through fp32) against the fp32 reference
    on the dequantized weights, and staged masks bitwise one pass, with the kernels compiled."""
    from moeflow import kernels
    from moeflow.kernels.experts.biased import biased_expert_forward_reference

    H, _, _, k = GPT_OSS_120B
    E = gpt_oss_pool.n_slots
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    ids = torch.topk(torch.rand(T, E, device="cuda", generator=gen), k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
    slot = torch.randperm(E, device="cuda", generator=gen).to(torch.int32)
    want = biased_expert_forward_reference(x.float(), ids, w, gpt_oss_pool, slot, torch.zeros(T * k, H, device="cuda"))
    got = kernels.expert_forward(x, ids, w, gpt_oss_pool, slot, torch.full((T * k, H), float("nan"), device="cuda",
                                                                           dtype=torch.bfloat16), backend="triton")
    assert not torch.isnan(got).any(), "output has unwritten (NaN-poisoned) rows"
    # exact weights; h and the outputs rounded to bf16: a few bf16 ulps of the largest output
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2
    staged = torch.full_like(got, float("nan"))
    first = torch.arange(E, device="cuda") % 2 == 0
    for mask in (first, ~first):
        kernels.expert_forward(x, ids, w, gpt_oss_pool, slot, staged, mask, backend="triton")
    assert torch.equal(staged, got)
    y = kernels.moe_forward(x, ids, w, gpt_oss_pool, slot, "triton")  # plan + stages + combine, as the model runs
    assert torch.equal(y, kernels.combine(got, k, "triton"))
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------
# 2. the race harness


class CudaSynthetic:
    """L layers of E random AWQ experts on the GPU, torch routers, a fixed sequence of layer calls (prefill, decode)."""

    def __init__(self, L=3, E=8, k=2, H=1024, I=2048, g=128, steps=8, prefill_tokens=64, seed=0):  # noqa: E741
        from test_scheduling_helpers import random_expert

        from moeflow.kernels.formats import expert_format

        self.fmt = expert_format(H, I, "awq", torch.float16, g)
        self.L, self.E, self.k = L, E, k
        gen = torch.Generator().manual_seed(seed)
        self.weights = {(la, e): random_expert(self.fmt, gen) for la in range(L) for e in range(E)}
        self.gates = [(torch.randn(E, H, generator=gen) / H**0.5).half().cuda() for _ in range(L)]
        self.steps = [[torch.randn(prefill_tokens if s == 0 else 1, H, generator=gen).half().cuda() for _ in range(L)]
                      for s in range(steps)]

    def resident(self):
        from moeflow.moe import ResidentExperts

        backend = ResidentExperts(self.fmt, self.L, self.E, "cuda", "triton")
        for (la, e), t in self.weights.items():
            backend.load_expert(la, e, {n: v.cuda() for n, v in t.items()})
        return backend

    def offloaded(self, transport, **config):
        from moeflow.config import OffloadConfig
        from moeflow.offload import REAL, Stats, create_expert_backend

        platform = dataclasses.replace(REAL, transport=lambda _config, _device: transport)
        gates = [torch.nn.Linear(self.fmt.hidden_size, self.E, bias=False, dtype=torch.float16, device="cuda")
                 for _ in range(self.L)]
        for lin, w in zip(gates, self.gates, strict=True):
            lin.weight.data.copy_(w)
        stats = Stats()
        backend = create_expert_backend(
            OffloadConfig(**config), fmt=self.fmt, num_layers=self.L, num_experts=self.E, top_k=self.k,
            device=torch.device("cuda"), kernels_backend="triton", gates=gates, reserved_bytes=0, stats=stats,
            platform=platform)
        for (la, e), t in self.weights.items():
            backend.load_expert(la, e, t)
        backend.finish_loading()
        return backend, stats

    def run(self, backend, stats=None) -> list[torch.Tensor]:
        """Each layer call's MoE output (a copy), in model order."""
        from moeflow.moe import route

        outs = []
        for s, xs in enumerate(self.steps):
            if stats is not None:
                stats.set_phase("prefill" if s == 0 else "decode")
            for layer, x in enumerate(xs):
                with torch.no_grad():
                    probs, ids, w = route(torch.nn.functional.linear(x, self.gates[layer]), self.k)
                    outs.append(backend.forward(layer, x, probs, ids, w).clone())
        torch.cuda.synchronize()
        return outs


@pytest.fixture(scope="module")
def race_synth():
    s = CudaSynthetic()
    return s, s.run(s.resident())


def _race_run(synth, drop, policy, slots, graphs=False, **config):
    """Each layer call's output through a RaceTransport; ``graphs``: with the backend's device part (expert groups
    + combine) replayed from CUDA graphs, the fences recorded on the compute stream before each replay (section 4).
    Returns (outputs, transport, the backend's DeviceGraphs or None)."""
    from contextlib import nullcontext

    from race_transport import RaceTransport

    from moeflow.engine.cuda_graphs import CudaCapture

    transport = RaceTransport(torch.device("cuda"), drop=drop)
    backend, stats = synth.offloaded(transport, policy=policy, gpu_expert_slots=slots, **config)
    device = backend.enable_device_graphs(CudaCapture) if graphs else None
    try:
        with device.region() if device is not None else nullcontext():
            got = synth.run(backend, stats)  # each layer's output cloned at once (a replayed one is static)
    finally:
        backend.close()
    return got, transport, device


@pytest.mark.parametrize("early_hits", [True, False])  # on CUDA on by default (docs/design.md)
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_race_harness_outputs_are_bitwise_resident(race_synth, policy, early_hits):
    synth, expected = race_synth
    for slots in (synth.k, synth.E, synth.L * synth.E - 1):
        got, transport, _ = _race_run(synth, None, policy, slots, early_hits=early_hits)
        assert transport.copies > 0
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), f"{policy} with {slots} slots: layer call {i} differs from resident"


@pytest.mark.parametrize("drop", ["compute-wait"])
def test_race_harness_catches_a_deleted_wait(race_synth, drop):
    """One wait_event deleted: some layer output must differ (poison read, or a slot overwritten under a kernel).
    If this fails, the harness cannot see that race and the test above proves nothing about it.

    Only "compute-wait" here: eagerly, each layer's one blocking read-back waits for the compute stream up to that
    layer's router, so every kernel that read a slot being evicted has finished before the host issues the copy,
    and the "copy-after" fence is already complete (a lent H100 confirmed it: deleting it changed no output). It
    matters when the host runs ahead of the kernels, as with the captured device part: shown in the test below."""
    synth, expected = race_synth
    caught = 0
    for policy in ("ondemand", "lru"):
        got, _, _ = _race_run(synth, drop, policy, synth.k, max_inflight_chunks=16)
        caught += sum(not torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert caught > 0, f"deleting the {drop} wait went unnoticed"


# ---------------------------------------------------------------------------------------------------------
# 3. every policy on real streams


def test_every_policy_keeps_the_tokens_on_real_streams(tmp_path):
    from helpers import make_tiny_checkpoint
    from test_policies import train_tiny_predictors

    from moeflow import POLICIES, MoEOffloadedMixtral, OffloadConfig
    from moeflow.offload.predictors import train_predictor
    from moeflow.tools.record import record_trace

    L, E, k = 3, 4, 2
    path = make_tiny_checkpoint(tmp_path / "m", seed=5, num_hidden_layers=L, num_local_experts=E,
                                num_experts_per_tok=k)
    train_tiny_predictors(path, path / "predictors")  # where duoserve / promoe / finemoe / auto look
    trace = record_trace(MoEOffloadedMixtral.from_pretrained(path, device="cpu"),
                         [list(range(3, 3 + n)) for n in (5, 9, 7, 12, 6, 8)], 6)
    train_predictor("expertflow", trace, epochs=4, seed=0, vocab_size=97).save(path / "predictors" / "expertflow.pt")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    load = dict(device="cuda", dtype=torch.float16, kernels="auto")
    # resident and every policy loaded alike (CUDA graphs by default, the bucketed cache): only offloading differs
    resident = MoEOffloadedMixtral.from_pretrained(path, **load, offload=OffloadConfig(policy="resident"))
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).cpu()
    failures = []
    for policy in POLICIES:
        if policy in ("resident", "fiddler"):  # fiddler computes on the CPU in bf16: close, not bitwise
            continue                            # (tests/test_claims.py bounds it); the rest must be bitwise
        for slots in (k, L * E // 2, L * E):
            model = MoEOffloadedMixtral.from_pretrained(
                path, **load, offload=OffloadConfig(policy=policy, gpu_expert_slots=slots))
            try:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).cpu()
            finally:
                model.experts.close()
            if not torch.equal(out, expected):
                failures.append(f"{policy} @ {slots} slots")
    assert not failures, failures


# ---------------------------------------------------------------------------------------------------------
# 4. the offload backend's device part captured as CUDA graphs (issue 14 item 6; moeflow/offload/device_step.py)


@pytest.mark.parametrize("early_hits", [True, False])
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_race_harness_with_the_captured_device_part_is_bitwise_resident(race_synth, policy, early_hits):
    synth, expected = race_synth
    for slots in (synth.k, synth.E, synth.L * synth.E - 1):
        got, _, graphs = _race_run(synth, None, policy, slots, graphs=True, early_hits=early_hits)
        assert graphs.refused == {} and graphs.disabled is None, (graphs.refused, graphs.disabled)
        assert graphs.captures == 2 and graphs.replays > len(expected)  # prefill and decode batch sizes
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), f"{policy} with {slots} slots: layer call {i} differs from resident (graphs)"


@pytest.mark.parametrize("drop", ["compute-wait", "copy-after"])
def test_race_harness_catches_a_deleted_wait_with_the_captured_device_part(race_synth, drop):
    """With the device part replayed, deleting one wait must still show (else the test above proves nothing)."""
    synth, expected = race_synth
    caught = 0
    for policy in ("ondemand", "lru"):
        got, _, graphs = _race_run(synth, drop, policy, synth.k, graphs=True, max_inflight_chunks=16)
        assert graphs.captures == 2
        caught += sum(not torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert caught > 0, f"deleting the {drop} wait went unnoticed with the captured device part"


@pytest.mark.parametrize(("policy", "kernels"), [("lru", "auto"), ("ondemand", "auto"), ("finemoe", "auto"),
                                                 ("expertflow", "auto"), ("lru", "torch")])
def test_cuda_graphs_capture_the_device_part_and_keep_the_tokens(policy, kernels):
    from pathlib import Path

    import moeflow
    from moeflow import MoEOffloadedMixtral, OffloadConfig

    model_dir = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
    load = dict(device="cuda", dtype=torch.float16, kernels=kernels)
    resident = MoEOffloadedMixtral.from_pretrained(model_dir, **load, offload=OffloadConfig(policy="resident"),
                                                   cuda_graphs=False)  # eager: the graphs' tokens are the subject
    resident.runner.reuse_cache = True  # the graph run's bucketed cache length: only replay vs eager differs
    ids = torch.tensor([resident.tokenizer.encode("The \"with\" statement is used to wrap the execution")] * 2,
                       device="cuda")
    expected = resident.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
    resident.close()
    model = MoEOffloadedMixtral.from_pretrained(
        model_dir, **load, offload=OffloadConfig(policy=policy, gpu_expert_slots=12), cuda_graphs=True)
    try:
        got = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
        again = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
        step, device = model.runner.decode_fn, model.experts.device_graphs
    finally:
        model.close()
    assert step.refused is None, step.refused
    assert device is not None and device.refused == {} and device.disabled is None, (device.refused, device.disabled)
    assert device.captures == 1 and device.replays > 2 * 15 * model.config.num_hidden_layers
    # the routing and the read-back staging in the pieces (moeflow/offload/prelude.py): plain policies on Triton
    preludes = [c.prelude is not None for c in step.step.calls]
    assert preludes == [policy in ("lru", "ondemand") and kernels == "auto"] * len(preludes), preludes
    assert torch.equal(got, expected) and torch.equal(again, expected)


# ---------------------------------------------------------------------------------------------------------
# 5. the split-K fixup with real concurrency


@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_fixup_is_bitwise_stable_across_launches_and_replays(mixtral_pool, split):
    from cuda_helpers import assert_bitwise_stable
    from test_kernels import assert_close

    from moeflow.kernels.experts.gemm import expert_gemm
    from moeflow.kernels.experts.reference import routing_plan_reference

    H, I, E, k, g = MIXTRAL  # noqa: E741
    t = mixtral_pool.tensors
    gen = torch.Generator(device="cuda").manual_seed(split)
    x = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
    ids = torch.tensor([[1, 6]], dtype=torch.int32, device="cuda")
    sorted_ids, eob, _ = routing_plan_reference(ids, E, 1)
    out = torch.empty(k, I, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(E, dtype=torch.int32, device="cuda")
    cfg = {"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}

    def launch() -> torch.Tensor:
        expert_gemm(0, x, (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"]), out, sorted_ids, eob, slots,
                    None, None, k, k, g, cfg)
        return out

    cfg["SPLIT_K"] = 1
    unsplit = launch().clone()
    cfg["SPLIT_K"] = split
    first = launch().clone()
    assert_close(first, unsplit, torch.bfloat16)  # the fixup's sum = one program's sum up to fp32 order
    assert_bitwise_stable(launch, out, first)
