"""The multi-token-prediction (MTP, "nextn") layers of a GGUF file, as llama.cpp's converter writes them.

``convert_hf_to_gguf.py`` appends a checkpoint's MTP layers after the decoder's blocks: ``{arch}.block_count``
counts them and ``{arch}.nextn_predict_layers`` says how many there are. MTP layer j is block ``blk.{N + j}`` (N:
the decoder's layers): its decoder block under the usual names (``attn_*``, ``ffn_gate_inp``,
``ffn_{gate,up,down}_exps``, ``exp_probs_b``, shared experts; glm4moe's ``post_attention_norm``, deepseek2's
``attn_k_b`` / ``attn_v_b``) and its own tensors under ``blk.{N + j}.nextn.*`` (gguf-py's ``MODEL_TENSOR.NEXTN_*``):
``eh_proj``, ``enorm``, ``hnorm``, ``shared_head_norm``, and the copies ``embed_tokens`` / ``shared_head_head``
(of the main model's embedding and head, not read).

Which conversions keep them (llama.cpp's ``conversion/``, October 2026): ``Glm4MoeModel`` (glm4moe: GLM-4.5 /
4.6 / 4.7) and ``Glm4MoeLiteModel`` (deepseek2: GLM-4.7-Flash) by default (``--no-mtp`` drops them);
``DeepseekV2Model`` (deepseek2: DeepSeek-V2 / V3 / R1, Kimi-K2) always drops them (``skip_mtp``), so a DeepSeek-V3
GGUF has none; Qwen3-Next / Qwen3.5's (``qwen3next`` / ``qwen35moe``), DeepSeek-V3.2's (``deepseek32``) and GLM-5's
(``glm-dsa``) keep theirs, but moeflow reads none of those architectures from GGUF.
"""

from __future__ import annotations

from typing import Any

# the MTP layer's own tensors, by gguf-py's MODEL_TENSOR names (HF ``model.layers.{bid}.eh_proj`` ->
# ``blk.{bid}.nextn.eh_proj``, both spellings from gguf-py's tables)
NEXTN_TENSORS = ("NEXTN_EH_PROJ", "NEXTN_ENORM", "NEXTN_HNORM", "NEXTN_SHARED_HEAD_NORM", "NEXTN_EMBED_TOKENS",
                 "NEXTN_SHARED_HEAD_HEAD")
# the GGUF architectures moeflow reads whose converter keeps the MTP layers (see the module doc)
KEPT_BY = {"glm4moe": "GLM-4.5 / 4.6 / 4.7",
           "deepseek2": "GLM-4.7-Flash (not DeepSeek-V3, whose conversion drops them)"}


def nextn_names(gguf: Any, blocks: tuple[int, ...]) -> dict[str, str]:
    """HF base name -> GGUF base name of the MTP layers' own tensors in ``blocks``, from gguf-py (module ``gguf``)'s
    tables, for every architecture (gguf-py 0.19's map of deepseek2 lacks them)."""
    out = {}
    for kind in NEXTN_TENSORS:
        tensor = gguf.MODEL_TENSOR[kind]
        for hf in gguf.TensorNameMap.block_mappings_cfg.get(tensor, ()):
            out.update({hf.format(bid=b): gguf.TENSOR_NAMES[tensor].format(bid=b) for b in blocks})
    return out


def mtp_blocks(config: dict[str, Any]) -> tuple[int, ...]:
    """The GGUF blocks (``blk.N``) of the MTP layers of a file whose config.json (as gguf_config made it) is
    ``config``: those past ``num_hidden_layers``."""
    n = int(config["num_hidden_layers"])
    return tuple(range(n, n + int(config.get("num_nextn_predict_layers") or 0)))


def no_mtp_layers(source: str, arch: str, metadata: dict[str, Any]) -> str:
    """The refusal of ``mtp=True`` for a GGUF file without MTP layers: names the file, the key and which conversions
    keep them; prompt lookup drafts without them."""
    key = f"{arch}.nextn_predict_layers"
    value = metadata.get(key)
    said = f"{key}={value}" if value is not None else f"no {key}"
    kept = f"llama.cpp's converter keeps them for {arch} files of {KEPT_BY[arch]} unless run with --no-mtp" \
        if arch in KEPT_BY else f"moeflow reads them from glm4moe and deepseek2 files, not {arch}"
    return (f"{source}: mtp=True but this GGUF file holds no multi-token-prediction (nextn) layers ({said}; {kept}); "
            "load with mtp=False: prompt_lookup_num_tokens drafts without them")
