"""Tiny random Qwen3-Next and Qwen3.5-MoE checkpoints written by transformers (hybrid Gated DeltaNet / gated
attention MoE models), for the family, delta-rule and invariant tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=16,
            max_position_embeddings=256, num_experts=6, num_experts_per_tok=2, linear_conv_kernel_dim=4,
            tie_word_embeddings=False)
QWEN3_NEXT = {
    # GQA attention every 2nd layer, 2 value heads per key head, a dense first layer, a shared expert
    "interval2-gqa-dense-first": dict(num_hidden_layers=4, full_attention_interval=2, num_key_value_heads=2,
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                      linear_value_head_dim=12, shared_expert_intermediate_size=48,
                                      intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=True),
    # the published pattern (3 linear, 1 full), MHA, one value head per key head, unnormalised top-k, half rotary
    "interval4-mha-unnormalised": dict(num_hidden_layers=4, full_attention_interval=4, num_key_value_heads=4,
                                       linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=16,
                                       linear_value_head_dim=8, shared_expert_intermediate_size=32,
                                       norm_topk_prob=False, num_experts_per_tok=3,
                                       rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                                                        "partial_rotary_factor": 0.5}),
}
QWEN3_5_MOE = {
    # explicit layer_types (full attention first), M-RoPE sections as published, 2 value heads per key head
    "full-first-mrope": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                               "linear_attention"],
                             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8, shared_expert_intermediate_size=48,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}),
    # interval 3, MHA, tied embeddings
    "interval3-tied": dict(num_hidden_layers=3, full_attention_interval=3, num_key_value_heads=4,
                           linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=16, shared_expert_intermediate_size=32, tie_word_embeddings=True,
                           num_experts_per_tok=3),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=16)


def make_model(kind: str, seed: int = 0, **overrides):
    """A random transformers ``Qwen3NextForCausalLM`` ("qwen3_next"), ``Qwen3_5MoeForCausalLM`` ("qwen3_5_moe_text")
    or ``Qwen3_5MoeForConditionalGeneration`` with a tiny vision tower ("qwen3_5_moe"), fp32, eval mode; weights
    scaled so routing and logits are far from ties, decays and write strengths spread over useful ranges."""
    import transformers

    fields = {**BASE, **overrides}
    if kind == "qwen3_next":
        model_cls, cfg = transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(**fields)
    elif kind == "qwen3_5_moe_text":
        model_cls, cfg = transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**fields)
    else:
        tie = fields.pop("tie_word_embeddings")
        cfg = transformers.Qwen3_5MoeConfig(text_config=fields, vision_config={**VISION, "out_hidden_size":
                                                                               fields["hidden_size"]},
                                            tie_word_embeddings=tie)
        model_cls = transformers.Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.8, 1.2)  # the gated norm's weight is stored as is
            elif "norm" in name:
                p.uniform_(-0.2, 0.2)  # zero-centred norms: 1 + w
            elif name.endswith("A_log"):
                p.uniform_(math.log(0.2), math.log(2.0))
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)
    if getattr(model.config, "tie_word_embeddings", False) or getattr(model.config.get_text_config(),
                                                                      "tie_word_embeddings", False):
        model.tie_weights()
    return model


def make_checkpoint(directory: str | Path, kind: str, seed: int = 0, **overrides) -> tuple[Path, object]:
    """Save a tiny random checkpoint of ``kind`` into ``directory``; returns (directory, the transformers model)."""
    model = make_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return Path(directory), model
