"""A GGUF file's Q4_0 / Q4_1 attention on ``device="cpu"`` (issue 42): read straight into the CPU int4 form with the
file's codes and scales (:mod:`moeflow.engine.gguf_linears`), each weight exactly the file's dequantized value, each
output the fp32 reference of those weights with the CPU path's int8 activations; the Q4_0 experts in the
zero-point-free group-32 form (resident) or with their zero points (offloaded slots): the same bits, so every
policy gives the resident model's greedy tokens. ~25 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_models import T, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.engine.gguf_linears import GGUFStoredLinears  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.kernels.cpu.q4_matrix import Q4_F16Z8, Q4_F32, Q4Matrix  # noqa: E402
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, SplitLinear, reference_linear  # noqa: E402
from moeflow.moe import CpuInt4Experts  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_gguf_q4")
    model = make_tiny_model(seed=5)  # a Mixtral (GGUF's llama architecture: q/k rows permuted in the file)
    out = {}
    for kind in ("Q4_0", "Q4_1"):
        out[kind] = root / f"{kind}.gguf"
        write_gguf(model, out[kind], expert_types=T.Q4_0, other_type=getattr(T, kind))
    out["mixed"] = root / "mixed.gguf"  # llama.cpp's Q4_0 for an 8-expert model: k and v in Q8_0
    write_gguf(model, out["mixed"], expert_types=T.Q4_0, other_type=T.Q4_0,
               types_by_suffix={"attn_k.weight": T.Q8_0, "attn_v.weight": T.Q8_0})
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield out
    mp.undo()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_stored_layers_are_the_files_weights(files, kind):
    """Each projection's int4 layer multiplies by exactly the file's dequantized weight (q/k un-permuted) and
    its outputs are the fp32 reference's with int8 activations, for 1 and 5 tokens (tail rows: k/v have 32)."""
    g = open_gguf(files[kind])
    stored = GGUFStoredLinears(g.reader, lambda m: f"model.{m}.weight")
    for layer in range(2):
        for p in PROJ:
            name = f"layers.{layer}.self_attn.{p}"
            lin = stored.cpu_linear(name)
            assert isinstance(lin, CpuQuantLinear) and lin.native and (lin.bits, lin.group_size) == (4, 32)
            m = Q4Matrix(lin.packed, lin.scales, lin.mins, 32)
            assert m.fmt == (Q4_F16Z8 if kind == "Q4_0" else Q4_F32)
            weight = g.reader.get(f"model.{name}.weight")
            assert torch.equal(m.dequantized(), weight), name
            for tokens in (1, 5):
                x = torch.randn(tokens, lin.in_features, generator=torch.Generator().manual_seed(tokens))
                ref = reference_linear(x, weight)
                torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert stored.cpu_linear("layers.0.input_layernorm") is None  # F32: not a stored int4 layer
    if kind == "Q4_0":  # 18 bytes per 32 weights, as in the file
        assert lin.nbytes == lin.out_features * lin.in_features // 32 * 18


def _decoder(model):
    return model.model


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_auto_keeps_the_files_attention_bits(files, kind):
    """``attention_bits="auto"`` (and 4) take the file's 4-bit attention as stored, fused q/k/v included; 8
    re-quantizes to int8 as asked; the greedy tokens of "auto" are those of the layers run one by one."""
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    for bits, want in (("auto", 4), (4, 4), (8, 8)):
        model = MoEModel.from_pretrained(files[kind], device="cpu", attention_bits=bits)
        try:
            attn = _decoder(model).layers[1].self_attn
            assert (attn.o_proj.bits, attn.qkv_proj.bits) == (want, want)
            if want == 4:
                assert attn.o_proj.group_size == 32 and attn.fused_qkv
            out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[])
            assert out.shape == (1, 10)
        finally:
            model.close()


def test_q4_0_q_beside_q8_0_k_and_v_runs_split(files):
    """Q4_0 q and o with Q8_0 k and v: q and o keep the file's codes, k / v fuse as the file's Q8_0 blocks
    (GGUFLinear), the step's q/k/v projection runs both (SplitLinear); its outputs are the three projections' side
    by side, and the one-call layers step gives the tokens of the layers run one by one."""
    from moeflow.kernels.cpu.gguf import GGUFLinear

    model = MoEModel.from_pretrained(files["mixed"], device="cpu")
    try:
        dec = _decoder(model)
        attn = dec.layers[0].self_attn
        assert (attn.q_proj.bits, attn.q_proj.group_size, attn.o_proj.bits) == (4, 32, 4)
        assert isinstance(attn.k_proj, GGUFLinear) and attn.k_proj.type.name == "Q8_0"
        assert isinstance(attn.qkv_proj, SplitLinear) and attn.fused_step and dec.layers_step is not None
        assert isinstance(attn.qkv_proj.parts[1], GGUFLinear)  # k and v: one matrix of the file's rows
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
        assert torch.equal(attn.qkv_proj(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1))
        ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
        one_call = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[])
        dec.layers_step.enabled = False  # each layer's attention half in its own native call
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[]), one_call)
    finally:
        model.close()
    model = MoEModel.from_pretrained(files["mixed"], device="cpu", attention_bits=4)  # k / v: int4 RTN of Q8_0 values
    try:
        parts = _decoder(model).layers[0].self_attn.qkv_proj.parts
        assert [(p.bits, p.group_size) for p in parts] == [(4, 32), (4, 64)]  # (g128, at most hidden 64)
        assert model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=[]).shape == (1, 9)
    finally:
        model.close()


@pytest.mark.parametrize("kind", ["Q4_0", "mixed"])
def test_every_policy_gives_the_resident_tokens_on_cpu(files, kind):
    """The exact-token invariant on ``device="cpu"`` with the file's Q4_0 attention and Q4_0 experts: resident
    experts in the zero-point-free form, offloaded slots in the form with zero points; the same tokens. "mixed":
    Q8_0 k / v beside Q4_0 q / o (the q/k/v projection in two parts)."""
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    resident = MoEModel.from_pretrained(files[kind], device="cpu", offload=OffloadConfig(policy="resident"))
    assert _decoder(resident).layers[0].self_attn.o_proj.group_size == 32
    assert resident.experts.experts[0][0].w13.fmt == Q4_F16Z8  # resident: no zero points stored
    # (converted at load whatever from_pretrained's mmap says: the form's 4-bit codes are regrouped in 8-row tiles
    # with the scales apart, not the file's 18-byte blocks; engine/mapped_experts.py maps the K-quants and Q8_0)
    assert type(resident.experts) is CpuInt4Experts
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=[])
    one = resident.generate(ids[:1], max_new_tokens=5, do_sample=False, eos_token_id=[])  # the one-call layers step
    resident.close()
    for policy in ("ondemand", "lru", "static", "mixtral-offloading"):
        for slots in (2, 5):
            model = MoEModel.from_pretrained(files[kind], device="cpu", offload=OffloadConfig(
                policy=policy, gpu_expert_slots=slots, transport="random-delay", random_delay_ms=0.2, seed=slots))
            try:
                assert "w13_mins" in {spec.name for spec in model.experts.fmt.specs}  # slots: zero points stored
                out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=[])
                assert torch.equal(out, expected), f"{policy} with {slots} slots: {out} != {expected}"
                out1 = model.generate(ids[:1], max_new_tokens=5, do_sample=False, eos_token_id=[])
                assert torch.equal(out1, one), f"{policy} with {slots} slots, one sequence"
            finally:
                model.close()
