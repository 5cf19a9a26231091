"""The whole model with the Triton kernels (CPU interpreter) and with torch.compile gives the reference's tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral
from moeflow.tools.quantize import quantize_checkpoint


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("kern")
    src = make_tiny_checkpoint(d / "fp32", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=64)
    return quantize_checkpoint(src, d / "awq", group_size=32, quantize_attention=True, progress=False)


def test_triton_kernels_give_the_reference_tokens(awq_checkpoint):
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="torch")
    tri = MoEOffloadedMixtral.from_pretrained(awq_checkpoint, kernels="triton")
    assert tri.kernels == "triton"
    a, b = tri(ids).logits, ref(ids).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    assert torch.equal(tri.generate(ids, max_new_tokens=6, eos_token_id=[]),
                       ref.generate(ids, max_new_tokens=6, eos_token_id=[]))


def test_compiled_decode_is_one_graph_without_recompiles(tmp_path):
    import torch._dynamo
    from torch._dynamo.utils import counters

    path = make_tiny_checkpoint(tmp_path, seed=1, num_hidden_layers=1)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    want = MoEOffloadedMixtral.from_pretrained(path).generate(ids, max_new_tokens=33, eos_token_id=[])
    torch._dynamo.reset()
    counters.clear()
    model = MoEOffloadedMixtral.from_pretrained(path, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, max_new_tokens=33, eos_token_id=[])  # 32 compiled decode steps
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
