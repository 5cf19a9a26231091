"""llama.cpp's ``deepseek2`` architecture (DeepSeek-V2 / V2-Lite, DeepSeek-V3 / R1, Kimi-K2, GLM-4.7-Flash) read as
moeflow's DeepSeek families (:mod:`moeflow.families.deepseek`).

Metadata (as ``convert_hf_to_gguf.py``'s ``DeepseekV2Model.set_gguf_parameters`` writes it and llama.cpp's
``llama_model_deepseek2::load_arch_hparams`` reads it):

* MLA: ``attention.q_lora_rank`` (absent: one ``q_proj``, V2-Lite), ``attention.kv_lora_rank``,
  ``rope.dimension_count`` (``qk_rope_head_dim``), ``attention.key_length_mla`` (``qk_nope + qk_rope``) and
  ``attention.value_length_mla`` (``v_head_dim``); files from converters before the MLA split have no ``*_mla``
  keys and say the per-head sizes in ``attention.key_length`` / ``value_length`` (the newer ones write the latent's
  there, ``kv_lora_rank + qk_rope`` and ``kv_lora_rank``). ``attention.head_count_kv`` is 1 (MLA as MQA) and not read.
* Router: ``expert_gating_func`` 2 (sigmoid, with ``exp_probs_b`` = ``e_score_correction_bias``) -> DeepSeek-V3
  (``noaux_tc``); 1 (softmax) -> DeepSeek-V2 (``greedy``, or ``group_limited_greedy`` with groups); absent -> softmax,
  as llama.cpp decides for the V2 files written before the key (its GLM-4.7-Flash exception, 47 / 48 layers with a
  154880 vocabulary, is kept). ``expert_group_count`` / ``expert_group_used_count`` -> ``n_group`` / ``topk_group``
  (llama.cpp scores a group by its top-2 sum for either router; transformers' V2 by its best expert, which moeflow
  follows), ``expert_weights_scale`` -> ``routed_scaling_factor`` (absent 1), ``expert_weights_norm`` ->
  ``norm_topk_prob`` (absent false: the converter writes it only when true), ``leading_dense_block_count``,
  ``expert_shared_count``, ``expert_feed_forward_length``; ``nextn_predict_layers`` (GLM-4.7-Flash's MTP layers,
  counted in ``block_count``, which the converter's ``Glm4MoeLiteModel`` keeps; its ``DeepseekV2Model`` drops
  DeepSeek-V3's) are taken off the decoder's layers and kept as ``num_nextn_predict_layers``, read with
  ``from_pretrained(mtp=True)`` (``blk.N.nextn.*`` and the block's own tensors, :mod:`moeflow.io.gguf.reader`).
* Rotary: llama.cpp runs deepseek2's rotary on interleaved pairs (``LLAMA_ROPE_TYPE_NORM``) and the converter does
  not permute q/k, so the file's weights are the checkpoint's with ``rope_interleave`` true. YaRN from
  ``rope.scaling.{factor, original_context_length, yarn_beta_fast, yarn_beta_slow}``; ``yarn_log_multiplier`` is
  ``0.1 * mscale_all_dim`` (the converter's ``[TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]``) and llama.cpp's graph takes
  ``mscale`` equal to it (the rotary's own magnitude cancelled, the softmax scaled by ``mscale(factor) ** 2``), as
  the published configs have it.

Tensors: the converter splits ``kv_b_proj`` ``[heads * (nope + v), R]`` into ``attn_k_b`` ``[heads, R, nope]``
(transposed, for llama.cpp's absorbed attention) and ``attn_v_b`` ``[heads, v, R]``; :class:`KvBJoin` joins them
back (older files: the combined ``attn_kv_b``, read as it is). Everything else maps by gguf-py's names.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from moeflow.errors import CheckpointError

KV_B = re.compile(r"^model\.layers\.(?P<block>\d+)\.self_attn\.kv_b_proj\.weight$")
SIGMOID, SOFTMAX = 2, 1  # gguf.ExpertGatingFuncType
GLM47_LITE = ((47, 48), 154880)  # llama.cpp's exception: (layers incl. MTP, vocabulary) read as sigmoid
KEYS = {"expert_count": "n_routed_experts", "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
        "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
        "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
        "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
        "rope.dimension_count": "qk_rope_head_dim", "nextn_predict_layers": "num_nextn_predict_layers"}


def derive_deepseek2(raw: dict[str, Any], metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                     source: str) -> None:
    """Complete ``raw`` (config.json so far, from :data:`KEYS` and the common keys) for a deepseek2 file."""
    a = "deepseek2"
    layers_in_file = int(raw["num_hidden_layers"])
    raw["num_hidden_layers"] = layers_in_file - int(raw.get("num_nextn_predict_layers") or 0)
    for name in ("kv_lora_rank", "qk_rope_head_dim"):
        if raw.get(name) is None:
            raise CheckpointError(f"{source}: a deepseek2 GGUF file without {a}.{_key(name)} (multi-head latent "
                                  "attention's sizes)")
    rope_dim = int(raw["qk_rope_head_dim"])
    k_mla, v_mla = metadata.get(f"{a}.attention.key_length_mla"), metadata.get(f"{a}.attention.value_length_mla")
    if k_mla is None:  # a converter before the MLA split: key_length / value_length are the per-head sizes
        k_mla, v_mla = metadata.get(f"{a}.attention.key_length"), metadata.get(f"{a}.attention.value_length")
    if k_mla is None or v_mla is None or int(k_mla) <= rope_dim:
        raise CheckpointError(f"{source}: {a}.attention.key_length_mla / value_length_mla (the per-head q/k and v "
                              f"sizes) are missing or not above rope.dimension_count={rope_dim}")
    raw["qk_nope_head_dim"], raw["v_head_dim"] = int(k_mla) - rope_dim, int(v_mla)
    raw.pop("head_dim", None)  # (key_length: the latent's size; the family derives head_dim)
    raw.pop("num_key_value_heads", None)  # (1: MLA written as MQA)
    raw["rope_interleave"] = True
    raw.setdefault("routed_scaling_factor", 1.0)
    raw.setdefault("n_shared_experts", 0)
    raw.setdefault("first_k_dense_replace", 0)
    gating = metadata.get(f"{a}.expert_gating_func")
    if gating is None:
        layers, vocab = GLM47_LITE
        gating = SIGMOID if layers_in_file in layers and raw.get("vocab_size") == vocab else SOFTMAX
    groups = int(raw.get("n_group") or 1)
    if gating == SIGMOID:
        raw.update(model_type="deepseek_v3", topk_method="noaux_tc", scoring_func="sigmoid")
        if not any(n.endswith("exp_probs_b.bias") for n in shapes):
            raise CheckpointError(f"{source}: a deepseek2 GGUF file with the sigmoid router but no exp_probs_b "
                                  "(the expert selection bias, e_score_correction_bias)")
    elif gating == SOFTMAX:
        raw.update(model_type="deepseek_v2", scoring_func="softmax",
                   topk_method="group_limited_greedy" if groups > 1 else "greedy")
    else:
        raise CheckpointError(f"{source}: {a}.expert_gating_func={gating}: moeflow reads the softmax (1) and "
                              "sigmoid (2) routers of deepseek2 files")
    raw["rope_scaling"] = _rope(metadata, source)
    if "blk.0.attn_kv_b.weight" not in shapes and "blk.0.attn_k_b.weight" not in shapes:
        raise CheckpointError(f"{source}: a deepseek2 GGUF file with neither attn_k_b / attn_v_b nor attn_kv_b "
                              "(MLA's kv_b_proj)")


def _key(name: str) -> str:
    return next(k for k, v in KEYS.items() if v == name)


def _rope(metadata: dict[str, Any], source: str) -> dict[str, Any]:
    a = "deepseek2"
    kind = metadata.get(f"{a}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default"}
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope scaling {kind!r} ({a}.rope.scaling.type) is not supported for deepseek2 "
                              "GGUF files (yarn or none)")
    get = lambda key: metadata.get(f"{a}.rope.scaling.{key}")  # noqa: E731
    if get("factor") is None or get("original_context_length") is None:
        raise CheckpointError(f"{source}: yarn rope scaling without {a}.rope.scaling.factor / original_context_length")
    for key in ("yarn_attn_factor", "yarn_ext_factor"):
        if get(key) not in (None, 1.0):
            raise CheckpointError(f"{source}: {a}.rope.scaling.{key}={get(key)} is not read (only 1.0)")
    rope = {"rope_type": "yarn", "factor": float(get("factor")),
            "original_max_position_embeddings": int(get("original_context_length")),
            "beta_fast": float(get("yarn_beta_fast") or 32.0), "beta_slow": float(get("yarn_beta_slow") or 1.0)}
    log_mul = get("yarn_log_multiplier")
    if log_mul is not None:  # 0.1 * mscale_all_dim; llama.cpp's graph takes mscale equal to it
        mscale = round(float(log_mul) / 0.1, 6)  # (the file's float32 of 0.1 * m, back to m)
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    return rope


class KvBJoin:
    """deepseek2's ``self_attn.kv_b_proj.weight``, which the newer converters store as ``attn_k_b`` and ``attn_v_b``
    (a :class:`~moeflow.io.gguf.config.JoinedTensors`; a file with the combined ``attn_kv_b`` answers it directly)."""

    def parts(self, name: str) -> tuple[str, ...] | None:
        """The GGUF tensors HF tensor ``name`` is joined from, or None when it is not one."""
        m = KV_B.match(name)
        return None if m is None else (f"blk.{m['block']}.attn_k_b.weight", f"blk.{m['block']}.attn_v_b.weight")

    def names(self, tensors: dict[str, Any]) -> list[str]:
        """The HF names of the joined tensors a file with these GGUF tensors holds."""
        blocks = [m[1] for n in tensors if (m := re.match(r"^blk\.(\d+)\.attn_k_b\.weight$", n))]
        return [f"model.layers.{b}.self_attn.kv_b_proj.weight" for b in blocks
                if f"blk.{b}.attn_v_b.weight" in tensors]

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """[heads * (nope + v), R] from the parts' shapes ([heads, R, nope], [heads, v, R])."""
        (heads, rank, nope), (_, v, _) = shapes
        return heads * (nope + v), rank

    def join(self, parts: list[torch.Tensor], source: str) -> torch.Tensor:
        """``kv_b_proj`` [heads * (nope + v), R] from ``attn_k_b`` [heads, R, nope] (transposed by the converter)
        and ``attn_v_b`` [heads, v, R]: each head's nope rows, then its v rows (transformers' layout)."""
        k_b, v_b = parts
        if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise CheckpointError(f"{source}: attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
                                  "[heads, R, nope] and [heads, v, R]")
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()
