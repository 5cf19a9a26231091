"""Tiny gpt-oss GGUF files written with gguf-py's GGUFWriter from the tests' tiny transformers gpt-oss, as llama.cpp's
converter (``conversion/gpt_oss.py``, ``GptOssModel``) lays them out: architecture ``gpt-oss``, the sliding window
and YaRN keys, ``post_attention_norm``, ``attn_sinks.weight``, q/k/v/o and router biases, the interleaved
``gate_up_proj`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (and their biases ``[E, I]``),
``ffn_down_exps`` ``[E, H, I]``, experts in MXFP4 by gguf-py's own quantizer (tensor names written out here, not
taken from moeflow).

:func:`write_gpt_oss_gguf` replaces the model's weights, in place, with gguf-py's dequantization of the bytes
written: the oracle moeflow's tokens on the GGUF are compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from gguf_models import CHAT_TEMPLATE, _vocab  # noqa: E402

T = gguf.GGMLQuantizationType
ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _stored(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, what gguf-py dequantizes it to in fp32)."""
    if qtype == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    data = quantize(w.astype(np.float32), qtype)
    return data, dequantize(data, qtype)


def write_gpt_oss_gguf(model, path: Path, expert_type=T.MXFP4, other_type=T.Q8_0) -> None:
    """Write ``model`` (a tiny transformers GptOssForCausalLM) to ``path`` as llama.cpp's converter would, then set
    every weight of ``model`` to gguf-py's dequantization of what was written. ``other_type``: the 2-D attention,
    embedding and output weights' ggml type (norms, biases, sinks and the router stay F32)."""
    cfg = model.config
    rope = dict(getattr(cfg, "rope_parameters", None) or cfg.rope_scaling)
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    tokens, types = _vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_bos_token_id(cfg.vocab_size - 3)
    w.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names[p + "input_layernorm.weight"] = b + "attn_norm.weight"
        names[p + "post_attention_layernorm.weight"] = b + "post_attention_norm.weight"
        names[p + "self_attn.sinks"] = b + "attn_sinks.weight"
        names[p + "mlp.router.weight"] = b + "ffn_gate_inp.weight"
        names[p + "mlp.router.bias"] = b + "ffn_gate_inp.bias"
        for hf, g in ATTENTION.items():
            for s in ("weight", "bias"):
                names[f"{p}self_attn.{hf}.{s}"] = f"{b}{g}.{s}"
    written: dict[str, np.ndarray] = {}
    for hf, name in names.items():
        t = sd[hf]
        qtype = other_type if t.ndim == 2 and "gate_inp" not in name else T.F32
        data, written[hf] = _stored(t, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.mlp.experts.", f"blk.{i}."
        gate_up, gate_up_bias = sd[p + "gate_up_proj"], sd[p + "gate_up_proj_bias"]  # [E, H, 2I] interleaved
        parts = {"gate": (gate_up[:, :, 0::2].transpose(0, 2, 1), gate_up_bias[:, 0::2]),
                 "up": (gate_up[:, :, 1::2].transpose(0, 2, 1), gate_up_bias[:, 1::2]),
                 "down": (sd[p + "down_proj"].transpose(0, 2, 1), sd[p + "down_proj_bias"])}
        for proj, (weight, bias) in parts.items():
            data, written[f"{i}.{proj}"] = _stored(np.ascontiguousarray(weight), expert_type)
            w.add_tensor(f"{b}ffn_{proj}_exps.weight", data, raw_dtype=expert_type)
            w.add_tensor(f"{b}ffn_{proj}_exps.bias", np.ascontiguousarray(bias, dtype=np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in written:
                param.copy_(torch.from_numpy(written[name]).reshape(param.shape))
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            ex.gate_up_proj[:, :, 0::2] = torch.from_numpy(written[f"{i}.gate"]).transpose(1, 2)
            ex.gate_up_proj[:, :, 1::2] = torch.from_numpy(written[f"{i}.up"]).transpose(1, 2)
            ex.down_proj.copy_(torch.from_numpy(written[f"{i}.down"]).transpose(1, 2))
