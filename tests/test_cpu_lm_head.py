"""``lm_head_bits=4`` (kernels/cpu/lm_head.py): int4 logits with the top candidates recomputed in int8.

Stated numerics: the candidates' logits are exactly the int8 head's (the same kernel on the same rows); the
other logits carry int4's error, within INT4_RTOL (relative norm; measured ~3-4% on the embedded model;
~10% for Gaussian random weights, GAUSSIAN_INT4_RTOL); the
greedy tokens equal the int8 head's and the fp32 reference's on the embedded model.
"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu.lm_head import EXACT_ROWS, RefinedInt4LmHead, refined_reference
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")

INT4_RTOL = 0.06
# Gaussian weights: round-to-nearest int4 over 128 of them steps by ~sigma/3, an error of ~step/sqrt(12) ~ 10%
GAUSSIAN_INT4_RTOL = 0.12
REF_RTOL = 1e-5
PROMPT = "The \"with\" statement is used to wrap the execution"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _head(seed: int = 0, vocab: int = 512, hidden: int = 256) -> tuple[RefinedInt4LmHead, torch.Tensor]:
    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05
    return RefinedInt4LmHead.quantize(w), w


def test_candidates_are_the_int8_logits_and_the_rest_int4():
    head, _ = _head()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    got = head(x)
    exact = head.int8(x)
    top = head.int4(x).topk(head.candidates, -1).indices  # the candidates: the int4 logits' largest
    assert torch.equal(got.gather(-1, top), exact.gather(-1, top))
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert rel(got, exact) < GAUSSIAN_INT4_RTOL
    ref = refined_reference(x, _dequantized_int4(head), head.int8.dequantized(), head.candidates)
    assert rel(got, ref) < REF_RTOL


def _dequantized_int4(head: RefinedInt4LmHead) -> torch.Tensor:
    m = head.int4
    return Q4Matrix(m.packed, m.scales, m.mins, m.group_size).dequantized()


def test_many_tokens_run_the_int8_head():
    head, _ = _head(2)
    x = torch.randn(EXACT_ROWS, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(head(x), head.int8(x))
    assert head.nbytes < head.int8.nbytes * 0.6


def test_embedded_model_int4_head_keeps_the_greedy_tokens():
    path = embedded_model_path()
    ref = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    ids = torch.tensor([ref.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        expected = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=[])
        model = MoEOffloadedMixtral.from_pretrained(path, lm_head_bits=4)
        assert isinstance(model.model.lm_head, RefinedInt4LmHead)
        assert torch.equal(model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=[]), expected)
        # every position's final hidden state through the head one token at a time (the decode path)
        hidden = []
        handle = model.model.norm.register_forward_hook(lambda m, a, out: hidden.append(out))
        model(expected)
        handle.remove()
        rows = hidden[0].reshape(-1, hidden[0].shape[-1])
        int4 = torch.cat([model.model.lm_head(r[None]) for r in rows])
        int8 = model.model.lm_head.int8(rows)
        assert torch.equal(int4.argmax(-1), int8.argmax(-1))
        err = rel(int4, int8)
        assert 0 < err < INT4_RTOL, f"int4 lm_head: relative logit error {err:.3f}"


def test_lm_head_bits_is_validated():
    path = embedded_model_path()
    with pytest.raises(ValueError, match="lm_head_bits=5"):
        MoEOffloadedMixtral.from_pretrained(path, lm_head_bits=5)
    with pytest.raises(ValueError, match="lm_head_bits=4"):
        MoEOffloadedMixtral.from_pretrained(path, kernels="torch", lm_head_bits=4)
