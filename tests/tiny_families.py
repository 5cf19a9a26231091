"""Tiny random DeepSeek-V2 / V3, GLM-4.5 and dots.llm1 checkpoints written by transformers, and the exact-token
invariant's steps on such models: predictors trained on a trace, one offloaded greedy run (shared by several
tests)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=2,
            tie_word_embeddings=False)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)

DEEPSEEK_V3 = {
    "qlora-groups-dense": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                               norm_topk_prob=True, routed_scaling_factor=2.5),
    "no-qlora-unnormalised": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                                  n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "yarn-halves-rope": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1, rope_interleave=False,
                             norm_topk_prob=True, routed_scaling_factor=1.5, num_experts_per_tok=3,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 32, "mscale": 0.9,
                                              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}
DEEPSEEK_V2 = {
    "greedy-no-qlora": dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1, n_shared_experts=2,
                            routed_scaling_factor=1.0),
    "group-limited-qlora": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=3.0,
                                num_experts_per_tok=3),
}
GLM4_MOE = {
    "qk-norm-bias-groups": dict(num_key_value_heads=2, head_dim=32, use_qk_norm=True, attention_bias=True,
                                n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5, partial_rotary_factor=0.5),
    "plain-unnormalised": dict(num_key_value_heads=4, use_qk_norm=False, attention_bias=False, n_group=1,
                               topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
                               routed_scaling_factor=1.0, n_shared_experts=2, partial_rotary_factor=0.25),
}

DOTS1 = {
    "groups-dense-shared": dict(num_key_value_heads=2, head_dim=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                                n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "mha-bias-unnormalised": dict(num_key_value_heads=4, attention_bias=True, n_group=1, topk_group=1,
                                  first_k_dense_replace=0, n_shared_experts=1, norm_topk_prob=False,
                                  routed_scaling_factor=1.0, num_experts_per_tok=3),
}


def make_model(kind: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV2/V3ForCausalLM, Glm4MoeForCausalLM or Dots1ForCausalLM (fp32, eval mode),
    its weights scaled up so routing and logits are far from ties; the selection bias is random too."""
    import transformers

    classes = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", MLA),
               "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {}),
               "dots1": ("Dots1Config", "Dots1ForCausalLM", {}),
               "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", MLA)}
    config_name, model_name, attention = classes[kind]
    cfg = getattr(transformers, config_name)(**{**BASE, **attention, **overrides})
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def make_checkpoint(directory: str | Path, kind: str, seed: int = 0, **overrides) -> tuple[Path, object]:
    """Save a tiny random checkpoint of ``kind`` into ``directory``; returns (directory, the transformers model)."""
    model = make_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return Path(directory), model


def assert_matches_transformers(model, ref, new_tokens: int = 32, seed: int = 3) -> None:
    """fp32 logits within 1e-4 (relative to the largest) and ``new_tokens`` greedy tokens equal to ``ref``'s."""
    ids = torch.randint(0, ref.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    got = model(ids).logits
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[]), want_tokens)


# ---------------------------------------------------------------- the exact-token invariant on these families
# predictor options of the predictive policies, small enough for the tiny models (6 experts, 97 tokens)
PREDICTOR_OPTIONS = {"duoserve": {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}, "promoe": {"epochs": 2},
                     "finemoe": {"capacity": 64}, "expertflow": {"epochs": 2, "vocab_size": 97}}


def train_predictors(resident, path: Path, gen: torch.Generator) -> None:
    """Record the resident model's trace on six random prompts (drawn from ``gen``) and train every predictive
    policy's predictor on it, saved where the policies look by default: ``<path>/predictors/<kind>.pt``."""
    from moeflow.offload.predictors import train_predictor
    from moeflow.trace.record import record_trace

    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6, 8, 5)]
    trace = record_trace(resident, prompts, max_new_tokens=6, hidden=True)
    for kind, opts in PREDICTOR_OPTIONS.items():
        train_predictor(kind, trace, eval_fraction=0.2, **opts).save(path / "predictors" / f"{kind}.pt")


def offloaded_generate(path: Path, ids: torch.Tensor, mask: torch.Tensor, policy: str, transport: str,
                       n_slots: int, new_tokens: int):
    """(greedy tokens, stats) of the checkpoint at ``path`` offloaded with ``policy`` into ``n_slots`` slots over
    ``transport`` (random delays of 0.3 ms, seeded by the slot count); the model is closed after."""
    from moeflow import MoEModel, OffloadConfig

    model = MoEModel.from_pretrained(path, offload=OffloadConfig(
        policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    finally:
        model.experts.close()
    return out, model.stats
