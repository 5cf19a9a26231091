"""Tiny random DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) checkpoints written by transformers, with
a small ``index_topk`` so that prompts longer than it make the sparse selection matter."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_families import BASE, MLA

INDEXER = dict(index_topk=6, index_head_dim=16, index_n_heads=8)
DEEPSEEK_V32 = {
    "groups-dense": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                         norm_topk_prob=True, routed_scaling_factor=2.5),
    "yarn-topk4-unnormalised": dict(q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=0,
                                    n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                                    index_topk=4, index_n_heads=12, index_head_dim=24, num_experts_per_tok=3,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 32, "mscale": 0.9,
                                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}
GLM_MOE_DSA = {
    "shared-indexers-dense": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                  num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]),
    "all-full-groups": dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=0, n_shared_experts=1,
                            norm_topk_prob=True, routed_scaling_factor=1.5, index_topk=5),
}
CLASSES = {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
           "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}


def make_dsa_model(kind: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM (fp32, eval), its weights scaled so
    routing, logits and the indexer's scores are far from ties (ReLU zeros, tied, rank last: ``weights_proj`` is
    positive); the selection bias is random too."""
    import transformers

    config_name, model_name = CLASSES[kind]
    cfg = getattr(transformers, config_name)(**{**BASE, **MLA, **INDEXER, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("weights_proj.weight"):  # positive: keys whose every head scores 0 rank last
                p.normal_(0.0, 0.5).abs_()
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") or ".indexer." in name else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def make_dsa_checkpoint(directory: str | Path, kind: str, seed: int = 0, **overrides) -> tuple[Path, object]:
    """Save a tiny random checkpoint of ``kind`` into ``directory``; returns (directory, the transformers model)."""
    model = make_dsa_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return Path(directory), model
