"""OLMoE (``olmoe``): OLMoE-1B-7B (64 experts, top-8 in every layer).

Softmax top-k routing (``norm_topk_prob`` false in the release), no shared expert and no dense layers,
QK-norm over the whole q / k projection (``self_attn.q_norm`` of ``hidden_size``, ``k_norm`` of
``kv_heads * head_dim``), optional clamping of q/k/v (``clip_qkv``) and attention biases
(``attention_bias``). The experts' size is config.json's ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from moeflow.families.llama_moe import LlamaMoEConfig, LlamaMoEFamily, common_fields, expert_count, require


class OlmoeFamily(LlamaMoEFamily):
    name = "olmoe"
    model_types = ("olmoe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaMoEConfig:
        fields = common_fields(raw, source)
        fields["rms_norm_eps"] = float(raw.get("rms_norm_eps", 1e-5))
        num_experts, key = expert_count(raw, source, ("num_experts", "num_local_experts"))
        require(raw, source, "intermediate_size")
        bias = bool(raw.get("attention_bias", False))
        clip = raw.get("clip_qkv")
        return LlamaMoEConfig(
            **fields, num_experts=num_experts, experts_key=key,
            moe_intermediate_size=int(raw["intermediate_size"]),
            moe_layer_ids=tuple(range(fields["num_hidden_layers"])),
            qkv_bias=bias, o_bias=bias, qk_norm="projection", clip_qkv=float(clip) if clip is not None else None,
        )
