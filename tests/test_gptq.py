"""GPTQ 4-bit (AutoGPTQ layout) -> AWQ GEMM layout, against a GPTQ packing written out by hand."""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import UnsupportedQuantizationError
from moeflow.quant.awq import dequantize, unpack_int4
from moeflow.quant.gptq import (
    check_sequential_groups,
    gptq_qweight_to_awq,
    gptq_qzeros_to_awq,
    gptq_settings,
    unpack_gptq_qweight,
)


def to_int32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def hand_pack_gptq(q: torch.Tensor, zeros: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published layout, literally: qweight word [r, n] holds q[8r + i, n] in bits 4i..4i+3; qzeros word
    [g, c] holds zero[g, 8c + i] - offset in bits 4i..4i+3."""
    k, n = q.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    for r in range(k // 8):
        for col in range(n):
            word = sum(int(q[8 * r + i, col]) << (4 * i) for i in range(8))
            qweight[r, col] = to_int32(word)
    groups = zeros.shape[0]
    qzeros = torch.zeros(groups, n // 8, dtype=torch.int32)
    for g in range(groups):
        for c in range(n // 8):
            word = sum((int(zeros[g, 8 * c + i]) - offset) << (4 * i) for i in range(8))
            qzeros[g, c] = to_int32(word)
    return qweight, qzeros


def test_known_word():
    q = torch.zeros(8, 8, dtype=torch.int64)
    q[:, 0] = torch.arange(1, 9)  # rows 0..7 of column 0 hold 1..8
    qweight, _ = hand_pack_gptq(q, torch.full((1, 8), 8), 1)
    assert int(qweight[0, 0]) & 0xFFFFFFFF == 0x87654321
    assert torch.equal(unpack_gptq_qweight(qweight)[:, 0], torch.arange(1, 9, dtype=torch.int32))


@pytest.mark.parametrize("group,offset,sym", [(32, 1, True), (128, 1, True), (32, 0, False)])
def test_conversion_keeps_the_weight(group, offset, sym):
    k, n = 2 * group, 24
    gen = torch.Generator().manual_seed(group + offset)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.full((k // group, n), 8) if sym else torch.randint(1, 16, (k // group, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) + 0.01).half()
    qweight, qzeros = hand_pack_gptq(q, zeros, offset)
    awq_qweight, awq_qzeros = gptq_qweight_to_awq(qweight), gptq_qzeros_to_awq(qzeros, offset)
    assert awq_qweight.shape == (k, n // 8) and awq_qzeros.shape == (k // group, n // 8)
    assert torch.equal(unpack_int4(awq_qweight), q.int()) and torch.equal(unpack_int4(awq_qzeros), zeros.int())
    want = (q - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)
    assert torch.equal(dequantize(awq_qweight, awq_qzeros, scales.float(), group), want)


def test_act_order_g_idx_is_refused():
    check_sequential_groups(torch.arange(64, dtype=torch.int32) // 32, 32, "x.g_idx")
    shuffled = (torch.arange(64) // 32)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(UnsupportedQuantizationError, match=r"x\.g_idx: .*act-order \(desc_act=true\)"):
        check_sequential_groups(shuffled.int(), 32, "x.g_idx")


def test_wrapped_v1_zero_is_refused():
    _, qzeros = hand_pack_gptq(torch.zeros(8, 8, dtype=torch.int64), torch.full((1, 8), 16), 1)  # stored 15
    with pytest.raises(UnsupportedQuantizationError, match="zero point of 16"):
        gptq_qzeros_to_awq(qzeros, 1)


def test_settings():
    published = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
                 "sym": True, "true_sequential": True, "quant_method": "gptq", "checkpoint_format": "gptq"}
    assert gptq_settings(published, "config.json") == (128, 1)
    assert gptq_settings({**published, "checkpoint_format": "gptq_v2"}, "config.json") == (128, 0)
    for change, match in ((dict(desc_act=True), "desc_act=true"), (dict(bits=8), "bits=8"),
                          (dict(sym=False), "sym=false"), (dict(group_size=-1), "group_size=-1"),
                          (dict(checkpoint_format="marlin"), "checkpoint_format='marlin'")):
        with pytest.raises(UnsupportedQuantizationError, match=match):
            gptq_settings({**published, **change}, "config.json")
