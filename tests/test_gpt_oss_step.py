"""gpt-oss's one-call CPU decode step (engine/cpu_layers_gpt_oss.py, kernels/cpu/step_gptoss.c): every layer of a
one-token step in one native call (MXFP4 experts on the pool's bytes, sink attention with the sliding window,
biased q/k/v/o and router), the per-layer path's numbers bit for bit (the lm_head's input at every decode step,
the greedy tokens) at 1, 2 and 3 threads, for the safetensors MXFP4 checkpoint (int8 and int4 attention) and a
GGUF file (Q8_0 attention on the file's blocks); offloaded (lru, the per-layer path on the slots) the same bits;
the per-layer path's native ops within 1e-4 of its torch ops with the same greedy tokens; where the step steps
aside; the attention and the routing ops against their torch models. ~20 s on 2 cores (loaded)."""

from __future__ import annotations

import pytest
import torch
from gpt_oss_helpers import gpt_oss_checkpoint_pair

import moeflow.engine.cpu_layers_gpt_oss as cpu_layers_gpt_oss
from moeflow import MoEModel, OffloadConfig
from moeflow.engine.cpu_step import set_cpu_step_fused
from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")
SHAPE = dict(num_hidden_layers=3, intermediate_size=96)  # sliding, full, sliding (window 4); 4 experts, top-2
NEW = 10  # decode steps past the 4-token window on the sliding layers


@pytest.fixture
def counted(monkeypatch):
    """How many passes the one native call took."""
    calls = [0]
    inner = cpu_layers_gpt_oss.gpt_oss_step

    def step(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(cpu_layers_gpt_oss, "gpt_oss_step", step)
    return calls


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny gpt-oss as a safetensors MXFP4 checkpoint and as a GGUF file (MXFP4 experts, Q8_0 attention)."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gpt_oss_step")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield gpt_oss_checkpoint_pair(root, 11, **SHAPE)
    mp.undo()


def _ids() -> torch.Tensor:
    return torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(4))


def _decode(model: MoEModel, native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens and the lm_head's input at every pass, the one call on or off."""
    model.model.layers_step.enabled = native
    seen = []
    hook = model.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with torch.inference_mode():
            out = model.generate(_ids(), max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    finally:
        hook.remove()
        model.model.layers_step.enabled = True
    return out, seen


@pytest.mark.parametrize("form, kw, projection", [("mxfp4", {}, CpuQuantLinear), ("mxfp4", {"attention_bits": 4},
                                                                                   CpuQuantLinear),
                                                  ("gguf", {}, GGUFLinear)])
def test_the_one_call_step_is_the_per_layer_step_on_1_2_and_3_threads(checkpoints, form, kw, projection, counted):
    model = MoEModel.from_pretrained(checkpoints[form], device="cpu", dtype=torch.float32, **kw)
    threads = torch.get_num_threads()
    try:
        q = model.model.layers[0].self_attn.q_proj
        assert isinstance(model.model.layers_step, cpu_layers_gpt_oss.NativeGptOssLayers)
        assert isinstance(q, projection) and (projection is GGUFLinear or q.bits == kw.get("attention_bits", 8))
        torch.set_num_threads(1)
        ref, ref_x = _decode(model, native=False)
        assert counted[0] == 0
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            counted[0] = 0
            out, x = _decode(model, native=True)
            assert counted[0] == NEW - 1  # every decode step (the prefill runs its layers one by one)
            assert torch.equal(out, ref), f"{t} threads"
            assert len(x) == len(ref_x) and all(torch.equal(a, b) for a, b in zip(x, ref_x, strict=True)), \
                f"{t} threads"
    finally:
        torch.set_num_threads(threads)
        model.close()


def test_offloaded_slots_give_the_resident_steps_bits(checkpoints, counted):
    """The exact-token invariant with the one call: lru at 2 and 3 slots (the per-layer path on the slots' bytes,
    the step's ops) gives the resident one-call step's lm_head inputs bit for bit."""
    resident = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32)
    try:
        want, want_x = _decode(resident, native=True)
        assert counted[0] == NEW - 1
    finally:
        resident.close()
    for slots in (2, 3):
        model = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32,
                                         offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        try:
            counted[0] = 0
            out, x = _decode(model, native=True)
            assert counted[0] == 0  # (not resident: the layers one by one)
            assert torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(x, want_x, strict=True))
        finally:
            model.close()


def test_the_step_ops_stay_within_1e_4_of_the_torch_ops(checkpoints):
    """The per-layer path's native norms, one-token sink attention and router (the step's ops) against the torch
    ops they replace (set_cpu_step_fused off): every pass's lm_head input within 1e-4 (relative norm), not equal
    (the ops did switch), the same greedy tokens."""
    model = MoEModel.from_pretrained(checkpoints["gguf"], device="cpu", dtype=torch.float32)
    try:
        out, x = _decode(model, native=True)
        set_cpu_step_fused(model.model, False)
        assert not model.model.layers[0].self_attn.native and not model.model.layers[0].mlp.gate.native
        ref, ref_x = _decode(model, native=False)
        set_cpu_step_fused(model.model, True)
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(x, ref_x, strict=True)]
        assert max(errs) < 1e-4 and max(errs) > 0, errs
        assert torch.equal(out, ref)
    finally:
        model.close()


def test_where_the_one_call_steps_aside(checkpoints, counted):
    """fp32 attention kept (attention_bits=None: nn.Linear projections, no native kernel): the layers one by one;
    a batch of two: likewise."""
    model = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32, attention_bits=None)
    try:
        assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        _decode(model, native=True)
        assert counted[0] == 0
    finally:
        model.close()
    model = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32)
    try:
        with torch.inference_mode():
            model.generate(_ids().repeat(2, 1), max_new_tokens=3, do_sample=False, eos_token_id=[])
        assert counted[0] == 0
    finally:
        model.close()


@pytest.mark.parametrize("n_heads, n_kv, window", [(4, 2, None), (8, 2, 3), (4, 4, 1)])
def test_sink_attention_step_matches_the_torch_sink_attention(n_heads, n_kv, window):
    """mf_sink_attn_step (the step's attention) against gpt_oss_layers.sink_attention after the torch rotary, on a
    cache with holes (padding) and a sliding window: the cache rows written as cache.update writes them (bit for
    bit: the rotary's products rounded as torch's), the output within 1e-5."""
    from moeflow.engine.kv_cache import attention_mask
    from moeflow.families.gpt_oss_layers import sink_attention
    from moeflow.families.layers import apply_rotary
    from moeflow.kernels.cpu.gpt_oss_step import sink_attention_step

    gen = torch.Generator().manual_seed(n_heads + n_kv)
    d, length, pos = 16, 12, 7
    q, k, v = (torch.randn(n * d, generator=gen) for n in (n_heads, n_kv, n_kv))
    cos, sin = torch.randn(2, d, generator=gen).unbind(0)
    k_cache, v_cache = (torch.randn(1, n_kv, length, d, generator=gen) for _ in range(2))
    sinks = torch.randn(n_heads, generator=gen) * 2
    valid = torch.ones(1, length, dtype=torch.bool)
    valid[0, 1:3] = False  # left padding
    mask = attention_mask(valid, torch.tensor([pos]), window)  # [1, 1, 1, L]
    kc, vc = k_cache.clone(), v_cache.clone()
    got = sink_attention_step(q, k, v, n_heads, n_kv, cos, sin, kc, vc, pos, mask.contiguous(), sinks, d ** -0.5)
    qh, kh = (apply_rotary(t.view(1, 1, n, d).transpose(1, 2), cos.view(1, 1, d), sin.view(1, 1, d))
              for t, n in ((q, n_heads), (k, n_kv)))
    k_cache[:, :, pos], v_cache[:, :, pos] = kh[:, :, 0], v.view(1, n_kv, d)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    want = sink_attention(qh, k_cache, v_cache, mask, sinks, d ** -0.5).reshape(-1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_topk_softmax_matches_topk_then_softmax():
    """mf_topk_softmax (the step's routing) against moe.routing.topk_then_softmax: the same ids (at a tie the
    lower expert first, where torch.topk's order is its own), weights within 1e-6, torch's probabilities."""
    from moeflow.kernels.cpu.gpt_oss_step import topk_softmax
    from moeflow.moe.routing import topk_then_softmax

    logits = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)) * 3
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
    probs, ids, weights = topk_softmax(logits, 4)
    want_probs, want_ids, want_weights = topk_then_softmax(logits, 4)
    assert ids[0, :2].tolist() == [5, 9] and set(want_ids[0, :2].tolist()) == {5, 9}
    assert torch.equal(ids[:, 2:], want_ids[:, 2:]) and torch.equal(ids[1:], want_ids[1:])
    assert torch.equal(probs, want_probs)
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
