"""A GGUF file's metadata as the config.json of the moeflow family that runs it.

llama.cpp names an architecture (``general.architecture``) and writes its hyperparameters under
``{arch}.<key>`` (gguf-py's ``gguf.Keys``: ``block_count``, ``attention.head_count``, ``expert_count``, ...).
:data:`ARCHITECTURES` says, per architecture moeflow runs, which transformers ``model_type`` it becomes and which
config.json field each key fills; what llama.cpp fixes in its C++ rather than the file (Qwen3-MoE renormalises
its top-k weights, Qwen2-MoE and OLMoE do not) is written beside it. The tokenizer's special token ids come from
``tokenizer.ggml.*``; ``tie_word_embeddings`` from whether the file has an ``output.weight``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moeflow.errors import CheckpointError
from moeflow.io.gguf.deepseek2 import KEYS as DEEPSEEK2_KEYS
from moeflow.io.gguf.deepseek2 import KvBJoin, derive_deepseek2

# {arch}.<key> -> config.json field, for every architecture below
COMMON = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta", "vocab_size": "vocab_size", "expert_used_count": "num_experts_per_tok",
}
TOKENIZER = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
             "tokenizer.ggml.padding_token_id": "pad_token_id"}


class JoinedTensors(Protocol):
    """HF tensors an architecture's files store as several GGUF tensors (deepseek2's ``kv_b_proj``)."""

    def parts(self, name: str) -> tuple[str, ...] | None:
        """The GGUF tensors HF tensor ``name`` is joined from, or None when it is not one."""

    def names(self, tensors: dict[str, Any]) -> list[str]:
        """The HF names of the joined tensors a file with these GGUF tensors (name -> anything) holds."""

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The joined tensor's shape from its parts' (outermost first)."""

    def join(self, parts: list[torch.Tensor], source: str) -> torch.Tensor:
        """The joined tensor from its parts (fp32, dequantized), in :meth:`parts`' order."""


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture becomes a config.json: its ``model_type``, keys beyond :data:`COMMON`, fixed
    fields, and whether llama.cpp's converter permuted the q/k rows for its interleaved rotary (``llama``)."""

    model_type: str
    keys: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    rope_permuted: bool = False
    requires_experts: bool = True
    rope_scaling: bool = False  # ``derive`` reads ``{arch}.rope.scaling.*`` (else any scaling is refused)
    # derive(raw, metadata, shapes, source): fields computed from several keys or from which tensors exist
    derive: Callable[[dict, dict, dict, str], None] | None = None
    joined: JoinedTensors | None = None  # HF tensors stored as several GGUF ones


def _glm4moe(raw: dict, metadata: dict, shapes: dict, source: str) -> None:
    """GLM-4.5: block_count counts the MTP (nextn) layers, the rotary turns ``rope.dimension_count`` of each head,
    QK-norm and q/k/v biases are there when their tensors are, the router is sigmoid without groups (llama.cpp's
    glm4moe graph has none)."""
    raw["num_hidden_layers"] -= int(raw.get("num_nextn_predict_layers") or 0)
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    rope_dim = metadata.get("glm4moe.rope.dimension_count")
    if rope_dim is not None:
        raw["partial_rotary_factor"] = int(rope_dim) / head_dim
    raw["use_qk_norm"] = "blk.0.attn_q_norm.weight" in shapes
    raw["attention_bias"] = "blk.0.attn_q.bias" in shapes
    gating = metadata.get("glm4moe.expert_gating_func", 2)
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise CheckpointError(f"{source}: glm4moe.expert_gating_func={gating}: only the sigmoid router (2) is read")


def _minimax_m2(raw: dict, metadata: dict, shapes: dict, source: str) -> None:
    """MiniMax-M2: rotary on ``rope.dimension_count`` values of each head, QK-norm and the selection bias when their
    tensors are there, sigmoid scores (llama.cpp's minimax-m2 graph)."""
    rope_dim = metadata.get("minimax-m2.rope.dimension_count")
    if rope_dim is not None:
        raw["rotary_dim"] = int(rope_dim)
    raw["use_qk_norm"] = "blk.0.attn_q_norm.weight" in shapes
    raw["use_routing_bias"] = "blk.0.exp_probs_b.bias" in shapes
    gating = metadata.get("minimax-m2.expert_gating_func", 2)
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise CheckpointError(f"{source}: minimax-m2.expert_gating_func={gating}: only the sigmoid router (2) is read")


def _gpt_oss(raw: dict, metadata: dict, shapes: dict, source: str) -> None:
    """gpt-oss: sliding-window layers by llama.cpp's pattern (``attention.sliding_window_pattern``, default 2: even
    layers slide, as transformers' ``layer_types``), YaRN from ``rope.scaling.*`` (``truncate: false``, the published
    config's and transformers' GptOssConfig's; llama.cpp's ggml rounds the correction range), the SwiGLU's alpha 1.702
    and limit 7.0 (llama.cpp fixes them in its graph; the file has no key), attention biases and sinks."""
    layers = int(raw["num_hidden_layers"])
    pattern = metadata.get("gpt-oss.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):  # one bool per layer
        if len(pattern) != layers:
            raise CheckpointError(f"{source}: gpt-oss.attention.sliding_window_pattern has {len(pattern)} entries "
                                  f"for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    kind = metadata.get("gpt-oss.rope.scaling.type")
    if kind == "yarn":
        rope = {"rope_type": "yarn", "truncate": False}
        for key, name in (("factor", "factor"), ("original_context_length", "original_max_position_embeddings"),
                          ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            value = metadata.get(f"gpt-oss.rope.scaling.{key}")
            if value is not None:
                rope[name] = value
        if metadata.get("gpt-oss.rope.scaling.yarn_ext_factor") not in (None, 1.0):
            raise CheckpointError(f"{source}: gpt-oss.rope.scaling.yarn_ext_factor="
                                  f"{metadata['gpt-oss.rope.scaling.yarn_ext_factor']} is not read (only 1.0)")
        raw["rope_scaling"] = rope
    elif kind not in (None, "none"):
        raise CheckpointError(f"{source}: rope scaling {kind!r} (gpt-oss.rope.scaling.type) is not supported for "
                              "gpt-oss GGUF files (yarn or none)")
    raw.update(swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True)
    # without attention.key_length llama.cpp's head size is embedding_length / head_count (GptOssConfig's is 64)
    raw.setdefault("head_dim", int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    missing = [t for t in ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias")
               if t not in shapes]
    if missing:
        raise CheckpointError(f"{source}: a gpt-oss GGUF file without {', '.join(missing)} (the attention sinks, "
                              "router and expert biases gpt-oss has)")


ARCHITECTURES: dict[str, Architecture] = {
    # Mixtral is llama.cpp's ``llama`` with experts (a llama file without them is a dense model moeflow does not run)
    "llama": Architecture("mixtral", {"expert_count": "num_local_experts"}, rope_permuted=True),
    "qwen3moe": Architecture("qwen3_moe", {"expert_count": "num_experts",
                                           "expert_feed_forward_length": "moe_intermediate_size"},
                             {"norm_topk_prob": True}),  # llama.cpp's qwen3moe graph renormalises the top-k weights
    "qwen2moe": Architecture("qwen2_moe", {"expert_count": "num_experts",
                                           "expert_feed_forward_length": "moe_intermediate_size",
                                           "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
                             {"norm_topk_prob": False}),
    # MiniMax-M2's experts are of intermediate_size; llama.cpp always renormalises its top-k
    "minimax-m2": Architecture("minimax_m2", {"expert_count": "num_local_experts",
                                              "expert_feed_forward_length": "intermediate_size"},
                               derive=_minimax_m2),
    # OLMoE's experts are of intermediate_size (llama.cpp writes expert_feed_forward_length)
    "glm4moe": Architecture("glm4_moe", {"expert_count": "n_routed_experts",
                                         "expert_feed_forward_length": "moe_intermediate_size",
                                         "expert_shared_count": "n_shared_experts",
                                         "leading_dense_block_count": "first_k_dense_replace",
                                         "expert_weights_scale": "routed_scaling_factor",
                                         "expert_weights_norm": "norm_topk_prob",
                                         "nextn_predict_layers": "num_nextn_predict_layers"},
                            {"n_group": 1, "topk_group": 1}, derive=_glm4moe),
    # gpt-oss: experts of intermediate_size (the converter writes it as expert_feed_forward_length too)
    "gpt-oss": Architecture("gpt_oss", {"expert_count": "num_local_experts",
                                        "expert_feed_forward_length": "intermediate_size",
                                        "attention.sliding_window": "sliding_window"},
                            rope_scaling=True, derive=_gpt_oss),
    # DeepSeek-V2 / V3 / R1, Kimi-K2, GLM-4.7-Flash: MLA, the router by expert_gating_func (moeflow/io/gguf/deepseek2)
    "deepseek2": Architecture("deepseek_v3", DEEPSEEK2_KEYS, rope_scaling=True, derive=derive_deepseek2,
                              joined=KvBJoin()),
    "olmoe": Architecture("olmoe", {"expert_count": "num_experts", "expert_feed_forward_length": "intermediate_size",
                                    "attention.clamp_kqv": "clip_qkv"}, {"norm_topk_prob": False}),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture(arch: str, source: str) -> Architecture:
    """The :class:`Architecture` of ``arch``; a CheckpointError listing the supported ones otherwise."""
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported; moeflow reads GGUF files of "
                              f"architecture {', '.join(supported_architectures())}")
    return spec


def gguf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """config.json (as a dict) for a GGUF file with this metadata and these tensors (name -> shape, outermost
    first)."""
    arch = str(metadata["general.architecture"])
    spec = architecture(arch, source)
    raw: dict[str, Any] = {"model_type": spec.model_type}
    for key, name in {**COMMON, **spec.keys}.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None and not isinstance(value, list):
            raw[name] = value
    for key, name in TOKENIZER.items():
        if key in metadata:
            raw[name] = int(metadata[key])
    if "vocab_size" not in raw and isinstance(metadata.get("tokenizer.ggml.tokens"), list):
        raw["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    if "vocab_size" not in raw and "token_embd.weight" in shapes:
        raw["vocab_size"] = shapes["token_embd.weight"][0]
    rope = metadata.get(f"{arch}.rope.scaling.type")
    if rope not in (None, "none") and not spec.rope_scaling:
        raise CheckpointError(f"{source}: rope scaling {rope!r} ({arch}.rope.scaling.type) is not supported for GGUF "
                              "files yet (only the default rotary)")
    if spec.requires_experts and not raw.get(spec.keys["expert_count"]):
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} without {arch}.expert_count is a dense model; "
                              "moeflow runs Mixture-of-Experts models")
    raw.update(spec.fixed)
    raw.setdefault("norm_topk_prob", False)  # llama.cpp's default when the file says nothing
    raw["tie_word_embeddings"] = "output.weight" not in shapes
    if spec.derive is not None:
        spec.derive(raw, metadata, shapes, source)
    return raw
