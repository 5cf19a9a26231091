"""Qwen3-MoE (``qwen3_moe``): Qwen3-30B-A3B, Qwen3-235B-A22B and their fine-tunes.

Softmax top-k routing renormalised when ``norm_topk_prob`` (true in the releases), no shared expert,
QK-norm per head (``self_attn.q_norm``/``k_norm`` over ``head_dim``), optional attention biases
(``attention_bias``), dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so. The
published config.json calls the expert count ``num_experts``; transformers 5.x writes ``num_local_experts``.
"""

from __future__ import annotations

from typing import Any

from moeflow.families.llama_moe import LlamaMoEConfig, LlamaMoEFamily, qwen_moe_fields


class Qwen3MoeFamily(LlamaMoEFamily):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaMoEConfig:
        fields = qwen_moe_fields(raw, source)
        # transformers 5.x: one sliding window for every layer when use_sliding_window (off in the releases)
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        bias = bool(raw.get("attention_bias", False))
        return LlamaMoEConfig(**fields, qkv_bias=bias, o_bias=bias, qk_norm="head",
                              layer_windows=(int(window),) * fields["num_hidden_layers"] if window else None)
