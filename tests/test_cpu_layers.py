"""Every decoder layer of a one-token CPU step as one native call (engine/cpu_layers.py, kernels/cpu/layers.py):
the same calls as the per-layer path, so the same numbers bit for bit (the lm_head's input of every decode step
equal, the same greedy tokens); taken only where the per-layer path would make exactly those calls."""

from __future__ import annotations

import pytest
import torch
from helpers import count_calls, make_tiny_checkpoint

import moeflow.engine.cpu_layers as cpu_layers
from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.cpu_step import set_cpu_step_fused
from moeflow.kernels.cpu.native import native_available
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")
PROMPT = "The \"with\" statement is used to wrap the execution"


@pytest.fixture
def counted(monkeypatch):
    """How many passes the one native call took."""
    return count_calls(monkeypatch, cpu_layers, "layers_step")


def _decode(model: MoEOffloadedMixtral, ids: torch.Tensor, native: bool, n: int = 12, **kw):
    """Greedy tokens and the lm_head's input at every pass (bit for bit what the layers produced)."""
    model.model.layers_step.enabled = native
    seen = []
    hook = model.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[], **kw)
    finally:
        hook.remove()
        model.model.layers_step.enabled = True
    return out, seen


def _check_same_step(model, ids, counted, **kw):
    counted[0] = 0
    ref, ref_x = _decode(model, ids, native=False, **kw)
    assert counted[0] == 0
    out, x = _decode(model, ids, native=True, **kw)
    assert counted[0] == len(x) - 1  # every decode step (the prefill runs its layers one by one)
    assert torch.equal(out, ref)
    assert len(x) == len(ref_x) and all(torch.equal(a, b) for a, b in zip(x, ref_x, strict=True))


@pytest.mark.parametrize("attention_bits,lm_head_bits", [(4, 8), (8, 8), (4, 4)])
def test_native_layers_are_the_per_layer_step_on_the_embedded_model(attention_bits, lm_head_bits, counted):
    path = embedded_model_path()
    model = MoEOffloadedMixtral.from_pretrained(path, attention_bits=attention_bits, lm_head_bits=lm_head_bits)
    assert model.model.layers_step is not None
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    _check_same_step(model, ids, counted)


def test_native_layers_on_an_awq_attention_checkpoint_and_where_they_step_aside(tmp_path, counted):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=3, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)
    awq = quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    model = MoEOffloadedMixtral.from_pretrained(awq)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    _check_same_step(model, ids, counted)
    # a batch of two rows (one token per row, but two tokens per pass): the layers run one by one
    counted[0] = 0
    two = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    _decode(model, two, native=True, n=4)
    assert counted[0] == 0
    # a hook on any layer module: the layers run one by one, so it sees its module run
    layer = model.model.layers[1]
    hits = []
    handle = layer.block_sparse_moe.gate.register_forward_hook(lambda m, a, o: hits.append(o.shape))
    try:
        _, with_hook = _decode(model, ids, native=True, n=4)
    finally:
        handle.remove()
    assert counted[0] == 0 and len(hits) == 4
    # switched off with the rest of the fused step: the unfused path, the same tokens
    set_cpu_step_fused(model.model, False)
    assert not model.model.layers_step.enabled
    with torch.inference_mode():
        off = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[])
    set_cpu_step_fused(model.model, True)
    assert counted[0] == 0
    on, _ = _decode(model, ids, native=True, n=4)
    assert counted[0] == 3 and torch.equal(on, off)


QWEN3_SHAPE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qk_norm_checkpoints(tmp_path_factory):
    """AWQ checkpoints (experts; attention 16-bit or AWQ too) of a tiny Qwen3-MoE (QK-norm per head), OLMoE
    (QK-norm over the projection, no renormalised top-k) and Qwen2-MoE (q/k/v biases, a shared expert with a sigmoid
    output gate)."""
    from family_models import make_family_checkpoint

    root = tmp_path_factory.mktemp("cpu_layers_qk_norm")
    out = {}
    for kind, shape in (("qwen3_moe", {**QWEN3_SHAPE, "norm_topk_prob": True}),
                        ("olmoe", {k: v for k, v in QWEN3_SHAPE.items() if k != "moe_intermediate_size"}),
                        ("qwen2_moe", {**QWEN3_SHAPE, "norm_topk_prob": True, "shared_expert_intermediate_size": 64})):
        src = make_family_checkpoint(root / kind, kind, seed=7, **shape)
        if kind != "qwen2_moe":  # (its shared expert would stay 16-bit: attention_bits does not quantize it)
            out[kind] = quantize_checkpoint(src, root / f"{kind}_awq", group_size=32, progress=False)
        out[f"{kind}_attn"] = quantize_checkpoint(src, root / f"{kind}_awq_attn", group_size=32,
                                                  quantize_attention=True, progress=False)
    return out


@pytest.mark.parametrize("kind,qk,kw", [("qwen3_moe", "head", dict(attention_bits=4)),
                                        ("qwen3_moe", "head", dict(attention_bits=8)),
                                        ("qwen3_moe_attn", "head", {}),
                                        ("olmoe_attn", "projection", {}),
                                        ("qwen2_moe_attn", None, {})])
def test_native_layers_with_a_qk_norm_are_the_per_layer_step(qk_norm_checkpoints, kind, qk, kw, counted):
    """Also Qwen2-MoE: its q/k/v bias inside the attention half, its shared expert inside the one call."""
    from moeflow import MoEModel

    model = MoEModel.from_pretrained(qk_norm_checkpoints[kind], device="cpu", **kw)
    try:
        attn = model.model.layers[0].self_attn
        assert attn.qk_norm == qk and attn.fused_step and model.model.layers_step is not None
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(6))
        _check_same_step(model, ids, counted, n=8)
        # the one call applies the QK-norm (the q/k/v bias, the shared expert's gate): with those weights
        # changed, the tokens' hidden states change
        _, before = _decode(model, ids, native=True, n=2)
        with torch.no_grad():
            if qk is None:
                attn.qkv_proj.bias.mul_(1.5)
                model.model.layers[0].mlp.shared_expert.output_gate.weight.mul_(-1.0)
            else:
                attn.k_norm.weight.mul_(1.5)
        _, after = _decode(model, ids, native=True, n=2)
        assert not torch.equal(before[-1], after[-1])
    finally:
        model.close()


def test_no_native_layers_without_the_one_call_attention_half():
    # 16-bit attention kept (attention_bits=None): the layers' attention is not one native call
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=None)
    assert model.model.layers[0].attention_step is None and model.model.layers_step is None


@pytest.mark.parametrize("kind", ["embedded", "qwen3_moe_attn", "olmoe_attn", "qwen2_moe_attn"])
def test_native_layers_give_the_same_bits_on_1_2_and_3_threads(qk_norm_checkpoints, kind, counted):
    """The one parallel region of step_region.c splits rows, kv heads and experts by the team's size (1 and 2
    threads: each thread its own kv heads' q/k/v rows and attention, OLMoE's QK-norm over the projection aside, and
    whole experts, Qwen2-MoE's shared expert aside; 3: every expert's rows across the team, the q/k/v rows, cache
    rows and query heads split apart): each output the same bits, the per-layer path's."""
    from moeflow import MoEModel

    path = embedded_model_path() if kind == "embedded" else qk_norm_checkpoints[kind]
    model = MoEModel.from_pretrained(path, device="cpu", **({"attention_bits": 4} if kind == "embedded" else {}))
    try:
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(8))
        _check_same_bits_on_1_2_3_threads(model, ids, 5, counted)
    finally:
        model.close()


def _check_same_bits_on_1_2_3_threads(model, ids: torch.Tensor, n: int, counted: list[int]) -> None:
    """``n`` greedy steps natively at 1, 2 and 3 threads: each gives the per-layer path's tokens and lm_head inputs
    bit for bit, with every decode step (n - 1) in one native call."""
    threads = torch.get_num_threads()
    try:
        ref, ref_x = _decode(model, ids, native=False, n=n)
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            counted[0] = 0
            out, x = _decode(model, ids, native=True, n=n)
            assert counted[0] == n - 1 and torch.equal(out, ref)
            assert all(torch.equal(a, b) for a, b in zip(x, ref_x, strict=True)), f"{t} threads"
    finally:
        torch.set_num_threads(threads)


# GGUF experts read as stored (kernels/cpu/gguf.c): per layer (gate/up type, down type); Q4_K_M mixes Q6_K and
# Q4_K down projections across layers
GGUF_MIXES = {"Q8_0": [("Q8_0", "Q8_0")] * 3, "Q4_K": [("Q4_K", "Q4_K")] * 3, "Q5_K": [("Q5_K", "Q5_K")] * 3,
              "Q6_K": [("Q6_K", "Q6_K")] * 3, "Q4_K_M": [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    pytest.importorskip("gguf")
    from gguf_models import T, k_mix_experts, write_gguf
    from helpers import make_tiny_model

    root = tmp_path_factory.mktemp("cpu_layers_gguf")
    model = make_tiny_model(seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_local_experts=4,
                            num_experts_per_tok=2)
    out = {}
    for name, mix in GGUF_MIXES.items():
        raw = None if name == "Q8_0" else k_mix_experts(mix, 4, 256, 256)  # Q8_0: gguf-py quantizes the model's
        out[name] = root / f"{name}.gguf"  # attention Q8_0 (int8 per row at load: the one-call attention half)
        write_gguf(model, out[name], expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw)
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield out
    mp.undo()


@pytest.fixture(scope="module")
def qwen3_q4_k_m(tmp_path_factory):
    """A tiny Qwen3-MoE (all layers MoE) as a GGUF file: Q4_K_M's expert mix, Q8_0 attention, F32 QK-norms."""
    pytest.importorskip("gguf")
    from family_models import make_family_model
    from gguf_models import T, k_mix_experts, write_gguf

    root = tmp_path_factory.mktemp("cpu_layers_qwen3_gguf")
    model = make_family_model("qwen3_moe", seed=9, **{**QWEN3_SHAPE, "hidden_size": 256, "moe_intermediate_size": 256,
                                                        "num_experts": 4, "norm_topk_prob": True})
    path = root / "qwen3_q4_k_m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=k_mix_experts(GGUF_MIXES["Q4_K_M"], 4,
                                                                                              256, 256))
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield path
    mp.undo()


def test_native_layers_on_a_qwen3_q4_k_m_gguf_are_the_per_layer_step(qwen3_q4_k_m, counted):
    from moeflow import MoEModel

    model = MoEModel.from_pretrained(qwen3_q4_k_m, dtype=torch.float32, device="cpu")
    try:
        fmt = model.experts.fmt
        assert fmt.kind == "gguf" and fmt.cpu_kernels and set(fmt.down_types) == {"Q4_K", "Q6_K"}
        assert model.model.layers[0].self_attn.qk_norm == "head" and model.model.layers_step is not None
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(5))
        _check_same_step(model, ids, counted, n=6)
    finally:
        model.close()


@pytest.mark.parametrize("kind", list(GGUF_MIXES))
def test_native_layers_with_gguf_experts_are_the_per_layer_step(gguf_files, kind, counted):
    from moeflow import MoEModel

    model = MoEModel.from_pretrained(gguf_files[kind], dtype=torch.float32, device="cpu")
    try:
        fmt = model.experts.fmt
        assert fmt.kind == "gguf" and fmt.cpu_kernels and model.model.layers_step is not None
        types = {t for layer in GGUF_MIXES[kind] for t in layer}
        assert set(fmt.gate_up_types) | set(fmt.down_types) == types
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
        _check_same_step(model, ids, counted, n=6)
    finally:
        model.close()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_native_layers_with_gguf_experts_give_the_same_bits_on_1_2_and_3_threads(gguf_files, kind, counted):
    """GGUF experts inside step_region.c's one parallel region (gguf.c's mf_gguf_expert_team: each expert's rows
    split across the team, 1, 2 or 3 threads): each output the same bits, the per-layer path's."""
    from moeflow import MoEModel

    model = MoEModel.from_pretrained(gguf_files[kind], dtype=torch.float32, device="cpu")
    try:
        assert model.experts.fmt.kind == "gguf" and model.model.layers_step is not None
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(6))
        _check_same_bits_on_1_2_3_threads(model, ids, 4, counted)
    finally:
        model.close()
