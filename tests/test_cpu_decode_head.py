"""The tail of the one-call CPU decode step (kernels/cpu/step_region.c's mf_decode_step, engine/cpu_layers.py's
``NativeLayers.logits``): the final RMSNorm and the int8 (or int4) lm_head after the last layer, in the same
parallel region, the rows shared out by the team. Each decode step's logits are, bit for bit, what the per-call
path computes from the same last-layer output (``lm_head(norm(x))``: mf_rmsnorm, then mf_q8_linear /
mf_q4_linear), at 1, 2 and 3 threads, with the greedy tokens of the model run without the one call. ~15 s."""

from __future__ import annotations

import pytest
import torch
from decode_tail_helpers import check_tail, record_tails

import moeflow.engine.cpu_layers as cpu_layers
from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu.lm_head import RefinedInt4LmHead
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.quant_linear import quantize_linear_cpu

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")
PROMPT = "The \"with\" statement is used to wrap the execution"


@pytest.fixture
def tails(monkeypatch):
    """Every call of the tail: (the last layer's output [1, 1, H], the logits [1, 1, V]) as copies."""
    return record_tails(monkeypatch, cpu_layers, "layers_step")


def _generate(model: MoEOffloadedMixtral, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])


def _check(model: MoEOffloadedMixtral, ids: torch.Tensor, n: int, tails: list) -> None:
    check_tail(model, lambda k: _generate(model, ids, k), n, tails)


def test_the_tail_is_the_per_call_head_on_1_2_3_threads(tails):
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=4, lm_head_bits=8)
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    _check(model, ids, 6, tails)
    # an int4 head (a native CpuQuantLinear of 4 bits): the tail runs it too, the same bits as its forward
    model.model.lm_head = quantize_linear_cpu(model.model.lm_head.dequantized(), bits=4, group_size=32)
    tails.clear()
    _check(model, ids, 4, tails)


def test_the_tail_runs_the_refined_int4_head(tails):
    """lm_head_bits=4 (lm_head.py's RefinedInt4LmHead): the int4 logits across the team, then its 16 largest
    recomputed in int8 by one thread (step_head.c's mf_head_refine): its forward's numbers."""
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=4, lm_head_bits=4)
    assert isinstance(model.model.lm_head, RefinedInt4LmHead)
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    _check(model, ids, 6, tails)
    # every logit but the candidates is the int4 head's: the candidates' differ (int8), the rest are equal
    x, logits = tails[-1]
    with torch.inference_mode():
        h = model.model.norm(x)
        int4, int8 = model.model.lm_head.int4(h), model.model.lm_head.int8(h)
    changed = (logits != int4).reshape(-1)
    assert 0 < int(changed.sum()) <= model.model.lm_head.candidates
    top = int4.reshape(-1).topk(model.model.lm_head.candidates).indices
    assert torch.equal(logits.reshape(-1)[top], int8.reshape(-1)[top])


def test_the_tail_steps_aside_for_a_hooked_norm(tails):
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), attention_bits=4, lm_head_bits=8)
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    seen = []
    hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:
        _generate(model, ids, 3)
    finally:
        hook.remove()
    assert not tails and len(seen) == 3  # a hook on the final norm: it runs as a module, every pass
    _generate(model, ids, 3)
    assert len(tails) == 2


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_the_tail_runs_a_gguf_files_head_on_its_blocks(tmp_path, monkeypatch, tails, kind):
    """A Q4_K_M-style file's Q6_K output.weight, or a Q8_0 one (llama.cpp's Q8_0 files, and gpt-oss's at any file
    type), as GGUFLinear on the file's blocks in the tail: gguf.c's mf_gguf_linear_team, mf_gguf_linear's numbers
    (the per-call GGUFLinear) at 1, 2 and 3 threads."""
    pytest.importorskip("gguf")
    from gguf_models import T, k_mix_experts, random_k_experts, write_gguf
    from helpers import make_tiny_model

    from moeflow import MoEModel
    from moeflow.kernels.cpu.gguf import GGUFLinear

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_local_experts=4,
                            num_experts_per_tok=2)
    raw = k_mix_experts([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")], 4, 256, 256)
    head = {"output.weight": (random_k_experts("Q6_K", 1, model.config.vocab_size, 9, 256)[0], T.Q6_K)} \
        if kind == "Q6_K" else {}  # (Q8_0: the writer quantizes the model's lm_head as every other tensor)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw, raw_tensors=head)
    resident = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu")
    try:
        assert isinstance(resident.model.lm_head, GGUFLinear) and resident.model.lm_head.type.name == kind
        ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
        _check(resident, ids, 5, tails)
    finally:
        resident.close()
