"""Synthetic checkpoints of session 9's families for the GPU lane (``gpu/families.py``): Qwen3-Next-80B-A3B
(``qwen3_next``), MiniMax-M2 (``minimax_m2``), DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``), in the
layout ``moeflow quantize`` writes from the published checkpoints: routed experts AWQ 4-bit (GEMM, group 128, zero
point, fp16 scales; per expert ``...experts.E.<proj>.{qweight,qzeros,scales}``), everything else bf16 under the
published names, config.json as published (fields the loader reads; ``num_hidden_layers`` cut to the slice) plus the
AWQ ``quantization_config``. MiniMax-M2 and DeepSeek-V3.2 are published FP8 (e4m3, 128 x 128 block scales), which
moeflow requantizes to int4 at every load (minutes at these sizes): the lane times what a user serves after one
``moeflow quantize``, so these are written in its output format. Qwen3-Next is published bf16 (community AWQ
conversions exist; ``moeflow quantize`` keeps its DeltaNet and attention projections 16-bit as here); GLM-5 is
published bf16 and as GLM-5-FP8.

The non-expert tensors' names and shapes come from the family itself: its decoder is built on the meta device and
each parameter / buffer is named by ``family.checkpoint_name``, exactly as the loader reads them, so a writer cannot
drift from the code. Values: embeddings N(0, 0.5), norms ones (zero-centred norms zeros), biases zeros (dt_bias
too), A_log uniform in [log 0.2, log 2] (decays as trained layers spread them), other weights N(0, 0.02); one random
tensor per distinct (name within its layer, shape) is reused by every layer (each layer its own shard, so
safetensors' no-shared-memory rule holds) and a few random expert templates round-robin: writing is bound by the
disk, not by the random numbers.

Slices (``DEFAULT_LAYERS``; the full models are 45-120 GB in AWQ, the lent machine has a 64 GiB disk):
Qwen3-Next 24 of 48 layers (18 linear-attention + 6 full-attention, the published 3:1 pattern; ~23 GB),
MiniMax-M2 10 of 62 (~22 GB), DeepSeek-V3.2 6 of 61 (its 3 dense layers + 3 MoE layers; ~26 GB), GLM-5 6 of 78
(3 dense + 3 MoE; ~23 GB). The configs' shapes were checked against the published files in session 11
(``benchmarks/results/family_shapes.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from benchmarks.common.checkpoint import random_awq_linear

# config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (the fields moeflow and transformers read)
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151936,
}
# config.json of MiniMaxAI/MiniMax-M2 (its FP8 quantization_config replaced by the AWQ one when written)
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-6, "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid",
    "shared_intermediate_size": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
}
# config.json of deepseek-ai/DeepSeek-V3.2 (likewise)
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}
# config.json of zai-org/GLM-5 (likewise): MLA with the DSA indexer on every layer, 3 dense layers, 256 experts
# top-8. Shapes checked against copies of the published file (sources: benchmarks/results/family_shapes.md);
# rope_theta 1e6, the eos list and the routing fields are the file's (transformers' GlmMoeDsaConfig defaults:
# 10000 and 1). layer_types / indexer_types are not in the file: they are what transformers derives from it (every
# layer indexed, every indexer full), written out so that slice_config cuts them with the layers.
GLM_5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": [154820, 154827, 154829], "first_k_dense_replace": 3, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
    "indexer_rope_interleave": True, "indexer_types": ["full"] * 78, "intermediate_size": 12288,
    "kv_lora_rank": 512, "layer_types": ["indexed_attention"] * 78, "max_position_embeddings": 202752,
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75, "model_type": "glm_moe_dsa", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1, "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-5, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
}
_SMALL = {"vocab_size": 97, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
TINY = {
    "qwen3_next": {**QWEN3_NEXT_80B, **_SMALL, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                   "num_hidden_layers": 4},
    "minimax_m2": {**MINIMAX_M2, **_SMALL, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "rotary_dim": 8, "intermediate_size": 64, "num_local_experts": 8,
                   "num_experts_per_tok": 2, "num_hidden_layers": 2, "attn_type_list": [1, 1]},
    "deepseek_v32": {**DEEPSEEK_V32, **_SMALL, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 64,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                     "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "index_head_dim": 16,
                     "index_n_heads": 4, "index_topk": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                     "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3},
}
TINY["glm_moe_dsa"] = {**GLM_5, **_SMALL, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 64,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 32,
                       "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24,
                       "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4,
                       "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                       "num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
                       "layer_types": ["indexed_attention"] * 3, "indexer_types": ["full"] * 3}
FULL = {"qwen3_next": QWEN3_NEXT_80B, "minimax_m2": MINIMAX_M2, "deepseek_v32": DEEPSEEK_V32, "glm_moe_dsa": GLM_5}
DEFAULT_LAYERS = {"qwen3_next": 24, "minimax_m2": 10, "deepseek_v32": 6, "glm_moe_dsa": 6}
# GB of device memory: the slices' non-expert weights take ~4.5 / ~3.5 / ~9 GB of them (DeepSeek: 3.7 GB of
# embedding + LM head, its dense layers and MLA projections)
BUDGETS_GB = {"qwen3_next": "8,12,16", "minimax_m2": "8,12,16", "deepseek_v32": "12,16,20", "glm_moe_dsa": "12,16,20"}
# (MoE block's name, (gate, up, down) projection names, expert intermediate size field)
EXPERTS = {"qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"),
           "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size"),
           "deepseek_v32": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"),
           "glm_moe_dsa": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size")}
TEMPLATES = 4


def slice_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers (the per-layer lists with it)."""
    n = cfg["num_hidden_layers"]
    cut = {k: v[:layers] for k, v in cfg.items() if isinstance(v, list) and len(v) == n and k != "architectures"}
    return {**cfg, **cut, "num_hidden_layers": layers}


def _family(cfg: dict):
    from moeflow.families import family_for_config

    return family_for_config(cfg, "synthetic config.json")


def _meta_decoder(family, dtype: torch.dtype):
    with torch.device("meta"):
        return family.build_decoder(dtype, lambda name, i, o, bias=False: torch.nn.Linear(i, o, bias=bias,
                                                                                           dtype=dtype))


def _value(module: torch.nn.Module, pname: str, shape: tuple[int, ...], dtype: torch.dtype,
           gen: torch.Generator) -> torch.Tensor:
    from moeflow.families.gated_deltanet import ZeroCenteredRMSNorm

    if isinstance(module, torch.nn.Embedding):  # as common/checkpoint.py's: token vectors far apart
        return torch.empty(shape, dtype=dtype).normal_(0.0, 0.5, generator=gen)
    if pname == "A_log":  # decays exp(-exp(A_log) softplus(.)) spread as trained layers spread them
        return torch.empty(shape).uniform_(math.log(0.2), math.log(2.0), generator=gen).to(dtype)
    if len(shape) == 1:
        fill = 0.0 if "bias" in pname or isinstance(module, ZeroCenteredRMSNorm) else 1.0
        return torch.full(shape, fill, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=gen)  # in place: one pass over the bytes


def non_expert_shards(cfg: dict, dtype: torch.dtype, seed: int = 0) -> Iterator[tuple[int | None, dict]]:
    """(decoder layer or None for the rest, {checkpoint name: tensor}) of every non-expert weight the family's
    loader reads, layer by layer, then embeddings / final norm / LM head."""
    from moeflow.families.base import ExpertLayout

    family = _family(cfg)
    layout = ExpertLayout(EXPERTS[cfg["model_type"]][0], fused=False, awq=True)
    decoder = _meta_decoder(family, dtype)
    gen = torch.Generator().manual_seed(seed)
    shared: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    per_layer: dict[int | None, dict[str, torch.Tensor]] = {}
    for module_name, module in decoder.named_modules():
        if module_name == "rotary":
            continue
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{pname}"
            layer = int(full.split(".")[1]) if full.startswith("layers.") else None
            local = full.split(".", 2)[2] if layer is not None else full
            key = (local, tuple(t.shape))
            if key not in shared:
                shared[key] = _value(module, pname, tuple(t.shape), t.dtype, gen)
            per_layer.setdefault(layer, {})[family.checkpoint_name(full, layout)] = shared[key]
    for layer in sorted(k for k in per_layer if k is not None):
        yield layer, per_layer[layer]
    yield None, per_layer.get(None, {})


def expert_tensors(cfg: dict, layer: int, group: int, templates: list[dict]) -> dict[str, torch.Tensor]:
    """Every routed expert of decoder ``layer`` in AWQ (templates round-robin, cloned: one storage per tensor)."""
    prefix, projs, _ = EXPERTS[cfg["model_type"]]
    n = _family(cfg).num_experts
    out = {}
    for e in range(n):
        for proj, parts in zip(projs, templates[(layer * n + e) % len(templates)], strict=True):
            for kind, tensor in parts.items():
                out[f"model.layers.{layer}.{prefix}.experts.{e}.{proj}.{kind}"] = tensor.clone()
    return out


def expert_templates(cfg: dict, group: int, gen: torch.Generator) -> list[tuple[dict, dict, dict]]:
    """A few random AWQ experts (gate, up, down) of the family's shapes."""
    h, i = cfg["hidden_size"], cfg[EXPERTS[cfg["model_type"]][2]]
    return [(random_awq_linear(h, i, group, gen), random_awq_linear(h, i, group, gen),
             random_awq_linear(i, h, group, gen)) for _ in range(TEMPLATES)]


def shards(cfg: dict, group: int, dtype: torch.dtype, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """One shard per decoder layer (its non-expert weights and, on an MoE layer, its experts), then the rest."""
    gen = torch.Generator().manual_seed(seed + 1)
    templates = expert_templates(cfg, group, gen)
    moe_layers = set(_family(cfg).moe_layers)
    for layer, tensors in non_expert_shards(cfg, dtype, seed):
        if layer is not None and layer in moe_layers:
            tensors = {**tensors, **expert_tensors(cfg, layer, group, templates)}
        yield tensors


def quantization_config(group: int) -> dict:
    """What ``moeflow quantize`` writes (AutoAWQ's GEMM format, experts only)."""
    return {"bits": 4, "group_size": group, "modules_to_not_convert": ["gate"], "quant_method": "awq",
            "version": "gemm", "zero_point": True}


def estimated_bytes(cfg: dict, group: int = 128, dtype: torch.dtype = torch.bfloat16) -> int:
    """Size of the checkpoint :func:`shards` writes, from the meta decoder (to refuse early when the disk is short)."""
    family = _family(cfg)
    decoder = _meta_decoder(family, dtype)
    dense = sum(t.numel() * t.element_size() for name, m in decoder.named_modules() if name != "rotary"
                for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    h, i = cfg["hidden_size"], cfg[EXPERTS[cfg["model_type"]][2]]
    expert = 3 * h * i // 2 + 3 * h * i // group * 2 + 3 * h * i // group // 2  # qweight, scales, qzeros
    return dense + len(family.moe_layers) * family.num_experts * expert
