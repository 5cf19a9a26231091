"""What the README and the embedded model's report.json claim, checked: expertflow and fiddler on every slot count,
the shipped model's held-out bits/byte recomputed from its weights, the fast AWQ -> int4 repack being the path taken.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu import int4 as cpu_int4

PROMPTS = ["def main():\n   ", "A list is a", "This module provides", "for i in range("]
NEW_TOKENS = 8
INT4_RTOL = 2e-2  # docs/hybrid.md: CPU experts run torch's int4 kernel on bf16 activations
MIN_MARGIN = 0.15  # reference top-1 minus top-2 logit along the greedy path of PROMPTS (the fixture checks it)


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (fp32 torch kernels), a left-padded batch of PROMPTS and its greedy continuation."""
    path = embedded_model_path()
    ref = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    enc = [list(p.encode()) for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.zeros((len(enc), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    expected = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    full_mask = torch.cat([mask, torch.ones(len(enc), NEW_TOKENS, dtype=torch.long)], dim=1)
    logits = ref(expected, attention_mask=full_mask).logits
    top2 = logits[:, width - 1 : -1].topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    assert margin > MIN_MARGIN, f"prompts too close to a tie for the test: margin {margin:.3f}"
    return path, ids, mask, expected, full_mask, logits, margin


def test_expertflow_exact_on_every_slot_count(embedded):
    """Policy "expertflow" (shipped predictor, micro-batches regrouped by predicted path): bitwise the resident
    tokens from the minimum of 2 slots to every expert, the transport alternating sync / random-delay."""
    path, ids, mask, expected, *_ = embedded
    total = 4 * 8
    for slots in range(2, total + 1):
        transport = "sync" if slots % 2 else "random-delay"
        model = MoEOffloadedMixtral.from_pretrained(path, kernels="torch", offload=OffloadConfig(
            policy="expertflow", gpu_expert_slots=slots, transport=transport, random_delay_ms=0.2, seed=slots))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[], micro_batch_size=2)
        finally:
            model.experts.close()
        assert torch.equal(out, expected), f"expertflow with {slots} slots ({transport})"


@pytest.mark.skipif(not cpu_int4.int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
def test_fiddler_greedy_equal_and_logits_close_on_every_slot_count(embedded):
    """Policy "fiddler" computes the experts it did not place on the device on the CPU (int4, bf16 activations),
    so it is exact only up to bf16 rounding: logits within INT4_RTOL (relative norm) of the fp32 resident model,
    every logit within half the reference's top-1 / top-2 margin (so the greedy choice cannot flip on PROMPTS),
    and the greedy tokens equal,
    on every slot count from 2 to all 32 experts."""
    path, ids, mask, expected, full_mask, logits, margin = embedded
    for slots in range(2, 33):
        model = MoEOffloadedMixtral.from_pretrained(path, kernels="torch",
                                                    offload=OffloadConfig(policy="fiddler", gpu_expert_slots=slots))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
            got = model(expected, attention_mask=full_mask).logits
            cpu_experts = model.stats.prefill.cpu_experts + model.stats.decode.cpu_experts
        finally:
            model.experts.close()
        rel = float((got - logits).norm() / logits.norm())
        worst = float((got - logits)[:, ids.shape[1] - 1 : -1].abs().max())
        assert rel < INT4_RTOL and worst < margin / 2, (
            f"margin {margin:.3f}; fiddler, {slots} slots: rel {rel:.2e}, max {worst:.3f}")
        assert torch.equal(out, expected), f"fiddler with {slots} slots"
        assert cpu_experts > 0 or slots == 32


def test_embedded_model_bits_per_byte_recomputed_from_its_weights():
    """report.json's held-out bits/byte (awq_torch) recomputed: the same 48 windows of 256 bytes of the training
    script's held-out split (scripts/build_embedded_model.py), the shipped AWQ weights, fp32 torch kernels."""
    from scripts.train_tiny_model import collect_corpus, split_corpus

    path = embedded_model_path()
    report = json.loads((path / "report.json").read_text())
    training = json.loads((path / "training_report.json").read_text())
    data, info = collect_corpus()
    if info["python"].split(".")[:2] != training["corpus"]["python"].split(".")[:2]:
        # the corpus is the interpreter's own documentation: another Python minor version has other text
        pytest.skip(f"the held-out text is Python {training['corpus']['python']}'s documentation; this is "
                    f"Python {info['python']}")
    assert info["sha256"] == training["corpus"]["sha256"], (
        f"the corpus differs from the training run's (Python {info['python']} vs {training['corpus']['python']})")
    held = torch.frombuffer(bytearray(split_corpus(data)[1]), dtype=torch.uint8).long()
    seq, n = report["seq_len"], report["heldout_windows"]
    step = max(1, (held.numel() - seq - 1) // n)
    windows = torch.stack([held[i * step : i * step + seq + 1] for i in range(n)])
    model = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    nll = 0.0
    with torch.inference_mode():
        for batch in windows.split(16):
            logits = model(batch[:, :-1]).logits
            nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                           batch[:, 1:].reshape(-1), reduction="sum"))
    bits = nll / (n * seq) / math.log(2)
    assert abs(bits - report["awq_torch"]["bits_per_byte"]) < 1e-4, (bits, report["awq_torch"])
    assert bits < 3.0  # learned text: uniform bytes would be 8 bits, a unigram model of this text ~4.5


@pytest.mark.skipif(not cpu_int4.int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
def test_fast_int4_repack_is_the_path_taken(monkeypatch):
    """On the pinned torch the byte-shuffle repack matches torch's conversion and is what awq_to_int4pack_cpu uses
    (a layout change in torch would otherwise fall back silently, 3-4x slower)."""
    q = torch.randint(-(2**31), 2**31 - 1, (256, 32), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int64).to(torch.int32)
    assert cpu_int4._repack_block() in (32, 64), f"torch {torch.__version__}: no byte repack matches its int4 layout"
    calls = []
    real = cpu_int4._repack_bytes
    monkeypatch.setattr(cpu_int4, "_repack_bytes", lambda w, block: calls.append(w.shape) or real(w, block))
    packed = cpu_int4.awq_to_int4pack_cpu(q)
    assert calls == [q.shape]
    from moeflow.quant.awq import unpack_int4

    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q).T.contiguous(), cpu_int4.INNER_K_TILES)
    assert torch.equal(packed, want)
