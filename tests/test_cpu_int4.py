"""torch's int4 CPU kernels as moeflow's CPU expert path for AWQ checkpoints."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral
from moeflow.kernels.cpu.int4 import (
    INNER_K_TILES,
    Int4Expert,
    awq_to_int4pack_cpu,
    int4_cpu_available,
    int4_expert_reference,
)
from moeflow.quant.awq import quantize_rtn, unpack_int4
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")

# bf16 activations: the kernel and its model round at the same points; what remains is summation order
# and bf16 output rounding of the two matmuls (a few bf16 ulps, 2^-8 relative each).
INT4_RTOL = 2e-2


def awq_expert(hidden, inter, group, seed):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    w2 = torch.randn(hidden, inter, generator=g)
    a1, a3, a2 = quantize_rtn(w1, group), quantize_rtn(w3, group), quantize_rtn(w2, group)
    return {
        "w13_qweight": torch.cat([a1.qweight, a3.qweight], 1), "w13_qzeros": torch.cat([a1.qzeros, a3.qzeros], 1),
        "w13_scales": torch.cat([a1.scales, a3.scales], 1), "w2_qweight": a2.qweight, "w2_qzeros": a2.qzeros,
        "w2_scales": a2.scales,
    }


@pytest.mark.parametrize("k,n", [(64, 96), (128, 160), (256, 512)])
def test_byte_repack_equals_torchs_conversion(k, n):
    """The byte-shuffle repack (64- or 32-column blocks, whichever this torch build uses) or its fallback."""
    q = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=torch.Generator().manual_seed(k),
                      dtype=torch.int64).to(torch.int32)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q).T.contiguous(), INNER_K_TILES)
    assert torch.equal(awq_to_int4pack_cpu(q), ref)


@pytest.mark.parametrize("hidden,inter,group,n", [(128, 256, 32, 1), (256, 128, 64, 7), (128, 384, 128, 33)])
def test_int4_expert_matches_its_reference(hidden, inter, group, n):
    t = awq_expert(hidden, inter, group, seed=n)
    rows = torch.randn(n, hidden)
    w = torch.rand(n)
    got = Int4Expert.from_awq_tensors(t, group).forward(rows, w)
    want = int4_expert_reference(t, group, rows, w)
    assert got.dtype == rows.dtype
    assert float((got - want).norm() / want.norm()) < INT4_RTOL


def test_cpu_int4_model_gives_greedy_tokens_of_the_reference(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=0, hidden_size=128, intermediate_size=128)
    awq = quantize_checkpoint(src, tmp_path / "awq", group_size=32, progress=False)
    # auto on the CPU -> cpu-int4 for AWQ experts; the 16-bit attention kept, so the experts' kernels are compared
    fast = MoEOffloadedMixtral.from_pretrained(awq, attention_bits=None)
    ref = MoEOffloadedMixtral.from_pretrained(awq, kernels="torch")
    assert fast.kernels == "cpu-int4" and ref.kernels == "torch"
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    a, b = fast(ids).logits, ref(ids).logits
    assert float((a - b).norm() / b.norm()) < INT4_RTOL
    got = fast.generate(ids, max_new_tokens=16, eos_token_id=[])
    want = ref.generate(ids, max_new_tokens=16, eos_token_id=[])
    # greedy equal wherever the reference's top-1 / top-2 margin exceeds the kernels' logit error: this random
    # model has near-ties (margins down to 0.02 against a ~0.05 logit error of int8 activations), and a flip at
    # one of them is the quantization's, not a bug; a flip at a clear margin fails
    differs = (got != want).any(0).nonzero()
    if len(differs):
        p = int(differs[0]) - 1  # the logits that chose the first differing token
        lr, lf = ref(want).logits[:, p], fast(want).logits[:, p]
        top = lr.topk(2, -1).values
        row = int((got[:, p + 1] != want[:, p + 1]).nonzero()[0])
        assert float(top[row, 0] - top[row, 1]) < 2 * float((lr - lf)[row].abs().max()), f"flip at position {p + 1}"


def test_cpu_int4_needs_cpu_and_awq(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "fp32", seed=0)
    with pytest.raises(ValueError, match="AWQ"):
        MoEOffloadedMixtral.from_pretrained(src, kernels="cpu-int4")
