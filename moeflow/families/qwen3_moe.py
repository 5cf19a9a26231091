"""Qwen3-MoE (``qwen3_moe``): Qwen3-30B-A3B, Qwen3-235B-A22B and their fine-tunes.

Softmax top-k routing renormalised when ``norm_topk_prob`` (true in the releases), no shared expert,
QK-norm per head (``self_attn.q_norm``/``k_norm`` over ``head_dim``), optional attention biases
(``attention_bias``), dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so. The
published config.json calls the expert count ``num_experts``; transformers 5.x writes ``num_local_experts``.
"""

from __future__ import annotations

from typing import Any

from moeflow.families.llama_moe import (
    LlamaMoEConfig,
    LlamaMoEFamily,
    common_fields,
    expert_count,
    require,
    sparse_layers,
)


class Qwen3MoeFamily(LlamaMoEFamily):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaMoEConfig:
        fields = common_fields(raw, source)
        num_experts, key = expert_count(raw, source, ("num_experts", "num_local_experts"))
        require(raw, source, "moe_intermediate_size")
        layers = fields["num_hidden_layers"]
        # transformers 5.x: one sliding window for every layer when use_sliding_window (off in the releases)
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        bias = bool(raw.get("attention_bias", False))
        return LlamaMoEConfig(
            **fields, num_experts=num_experts, experts_key=key,
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_layer_ids=sparse_layers(layers, num_experts, raw.get("decoder_sparse_step", 1),
                                        raw.get("mlp_only_layers")),
            qkv_bias=bias, o_bias=bias, qk_norm="head",
            layer_windows=(int(window),) * layers if window else None,
        )
