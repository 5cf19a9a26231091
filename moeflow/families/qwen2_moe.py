"""Qwen2-MoE (``qwen2_moe``): Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B.

Softmax top-k routing (``norm_topk_prob`` false in the releases), a shared expert of
``shared_expert_intermediate_size`` beside the routed ones, scaled by ``sigmoid(mlp.shared_expert_gate(x))``
and kept resident; q/k/v biases (``qkv_bias``, true unless said otherwise); dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say so; sliding-window attention on the layers transformers
5.x marks ``sliding_attention`` in ``layer_types`` when ``use_sliding_window`` (off in the releases).
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


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...] | None:
    """The sliding window of each layer (None: full attention), as transformers 5.x's Qwen2-MoE decides it."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window") or not window:
        return None
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < raw.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


class Qwen2MoeFamily(LlamaMoEFamily):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaMoEConfig:
        fields = common_fields(raw, source)
        num_experts, key = expert_count(raw, source, ("num_experts", "num_local_experts"))
        require(raw, source, "moe_intermediate_size")
        layers = fields["num_hidden_layers"]
        return LlamaMoEConfig(
            **fields, num_experts=num_experts, experts_key=key,
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_layer_ids=sparse_layers(layers, num_experts, raw.get("decoder_sparse_step", 1),
                                        raw.get("mlp_only_layers")),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            shared_expert_gate=True, qkv_bias=bool(raw.get("qkv_bias", True)),
            layer_windows=layer_windows(raw, layers),
        )
