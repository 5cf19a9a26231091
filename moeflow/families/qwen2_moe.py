"""Qwen2-MoE (``qwen2_moe``): Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B.

Softmax top-k routing (``norm_topk_prob`` false in the releases), a shared expert of
``shared_expert_intermediate_size`` beside the routed ones, scaled by ``sigmoid(mlp.shared_expert_gate(x))``
and kept resident; q/k/v biases (``qkv_bias``, true unless said otherwise); dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say so; sliding-window attention on the layers transformers
5.x marks ``sliding_attention`` in ``layer_types`` when ``use_sliding_window`` (off in the releases).
"""

from __future__ import annotations

from typing import Any

from moeflow.families.llama_moe import LlamaMoEConfig, LlamaMoEFamily, qwen_moe_fields


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
        fields = qwen_moe_fields(raw, source)
        return LlamaMoEConfig(
            **fields, shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            shared_expert_gate=True, qkv_bias=bool(raw.get("qkv_bias", True)),
            layer_windows=layer_windows(raw, fields["num_hidden_layers"]),
        )
