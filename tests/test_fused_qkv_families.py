"""q/k/v fused at load in the families that build attention from AWQ q/k/v (TRITON_INTERPRET=1): Qwen2-MoE with
biases, Qwen3-MoE and OLMoE with QK-norm, GLM-4.5 with partial rotary: fused, the torch reference's tokens, the
unfused path's logits (within an ulp). Mixtral's fused projection, launches and offloaded tokens:
tests/test_fused_qkv.py."""

from __future__ import annotations

import pytest
import torch
from family_models import make_family_checkpoint
from tiny_families import GLM4_MOE, make_checkpoint

from moeflow import MoEModel
from moeflow.tools.quantize import quantize_checkpoint

GROUP = 32


@pytest.fixture(autouse=True)
def _no_value_checks(monkeypatch):
    # the CPU-only value checks of the kernels' arguments (skipped on a GPU) are not the GPU path's work
    monkeypatch.setenv("MOEFLOW_KERNEL_CHECKS", "0")


def _fused_attention(model) -> list[torch.nn.Module]:
    return [m for m in model.model.modules() if hasattr(m, "fused_qkv")]


FAMILIES = {  # name: (checkpoint maker, the family's attention options exercised)
    "qwen2-biases": lambda d: make_family_checkpoint(d, "qwen2_moe", seed=0, shared_expert_intermediate_size=64,
                                                     intermediate_size=64),
    "qwen3-head-norm": lambda d: make_family_checkpoint(d, "qwen3_moe", seed=0, norm_topk_prob=True),
    "olmoe-projection-norm": lambda d: make_family_checkpoint(d, "olmoe", seed=0),
    "glm45-partial-rotary": lambda d: make_checkpoint(d, "glm4_moe", seed=0, **GLM4_MOE["plain-unnormalised"])[0],
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_fuse_qkv_and_keep_the_reference_tokens(tmp_path, name):
    src = FAMILIES[name](tmp_path / "fp32")
    dst = quantize_checkpoint(src, tmp_path / "awq", group_size=GROUP, quantize_attention=True, progress=False)
    fused = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="triton")
    attention = _fused_attention(fused)
    assert attention and all(a.fused_qkv for a in attention)
    if name == "qwen2-biases":
        assert all(a.qkv_proj.bias is not None for a in attention)
    ref = MoEModel.from_pretrained(dst, dtype=torch.float32, kernels="torch")
    assert not any(a.fused_qkv for a in _fused_attention(ref))
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    got, want = fused(ids).logits, ref(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    tokens = fused.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[])
    assert torch.equal(tokens, ref.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[]))
    for a in attention:  # apart (q/k/v narrower than a BLOCK_N tile here: within an ulp, not bitwise)
        a.fused_qkv = False
    torch.testing.assert_close(fused(ids).logits, got, rtol=1e-5, atol=1e-5)
