"""Tiny gpt-oss GGUF files written with gguf-py's GGUFWriter from the tests' tiny transformers gpt-oss, as llama.cpp's
converter (``conversion/gpt_oss.py``, ``GptOssModel``) lays them out: architecture ``gpt-oss``, the sliding window
and YaRN keys, ``post_attention_norm``, ``attn_sinks.weight``, q/k/v/o and router biases, the interleaved
``gate_up_proj`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (and their biases ``[E, I]``),
``ffn_down_exps`` ``[E, H, I]``, experts in MXFP4 by gguf-py's own quantizer (tensor names written out here, not
taken from moeflow).

:func:`write_gpt_oss_gguf` (and :func:`reference_from_file`, for files llama.cpp's own tools made) replaces the
model's weights, in place, with gguf-py's dequantization of the file: the oracle moeflow's tokens are compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from gguf_models import add_test_vocab  # noqa: E402

T = gguf.GGMLQuantizationType
ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _stored(w: np.ndarray, qtype) -> np.ndarray:
    """What to write: ``w`` in ggml type ``qtype`` (gguf-py's quantizer)."""
    return w.astype(np.float32) if qtype == T.F32 else quantize(w.astype(np.float32), qtype)


def write_gpt_oss_gguf(model, path: Path, expert_type=T.MXFP4, other_type=T.Q8_0, leave_out: str | None = None
                       ) -> None:
    """Write ``model`` (a tiny transformers GptOssForCausalLM) to ``path`` as llama.cpp's converter would, then set
    every weight of ``model`` to gguf-py's dequantization of what was written. ``other_type``: the 2-D attention,
    embedding and output weights' ggml type (norms, biases, sinks and the router stay F32). ``leave_out``: tensors
    whose name contains it are not written (a broken file; ``model`` is then left as it was)."""
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
    add_test_vocab(w, cfg.vocab_size, "gpt-4o")

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add = w.add_tensor
    w.add_tensor = lambda name, *a, **k: None if leave_out and leave_out in name else add(name, *a, **k)
    for hf, name in gguf_names(cfg).items():
        t = sd[hf]
        qtype = other_type if t.ndim == 2 and "gate_inp" not in name else T.F32
        w.add_tensor(name, _stored(t, qtype), raw_dtype=qtype)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.mlp.experts.", f"blk.{i}."
        gate_up, gate_up_bias = sd[p + "gate_up_proj"], sd[p + "gate_up_proj_bias"]  # [E, H, 2I] interleaved
        parts = {"gate": (gate_up[:, :, 0::2].transpose(0, 2, 1), gate_up_bias[:, 0::2]),
                 "up": (gate_up[:, :, 1::2].transpose(0, 2, 1), gate_up_bias[:, 1::2]),
                 "down": (sd[p + "down_proj"].transpose(0, 2, 1), sd[p + "down_proj_bias"])}
        for proj, (weight, bias) in parts.items():
            w.add_tensor(f"{b}ffn_{proj}_exps.weight", _stored(np.ascontiguousarray(weight), expert_type),
                         raw_dtype=expert_type)
            w.add_tensor(f"{b}ffn_{proj}_exps.bias", np.ascontiguousarray(bias, dtype=np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    if leave_out is None:
        reference_from_file(model, path)


def gguf_names(cfg) -> dict[str, str]:
    """HF state-dict name -> llama.cpp tensor name of gpt-oss's non-expert tensors."""
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
    return names


def reference_from_file(model, path: Path):
    """``model`` (a tiny transformers GptOssForCausalLM) with every weight replaced, in place, by gguf-py's
    dequantization of the gpt-oss GGUF file at ``path`` (written here, or by llama.cpp's converter and
    llama-quantize); gate and up re-interleaved into ``gate_up_proj``."""
    stored = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(
        [int(d) for d in reversed(t.shape.tolist())]) for t in gguf.GGUFReader(path).tensors}
    with torch.no_grad():
        for hf, name in gguf_names(model.config).items():
            param = model.get_parameter(hf)
            param.copy_(stored[name].reshape(param.shape))
        for i, layer in enumerate(model.model.layers):
            ex, b = layer.mlp.experts, f"blk.{i}."
            ex.gate_up_proj[:, :, 0::2] = stored[b + "ffn_gate_exps.weight"].transpose(1, 2)
            ex.gate_up_proj[:, :, 1::2] = stored[b + "ffn_up_exps.weight"].transpose(1, 2)
            ex.gate_up_proj_bias[:, 0::2] = stored[b + "ffn_gate_exps.bias"]
            ex.gate_up_proj_bias[:, 1::2] = stored[b + "ffn_up_exps.bias"]
            ex.down_proj.copy_(stored[b + "ffn_down_exps.weight"].transpose(1, 2))
            ex.down_proj_bias.copy_(stored[b + "ffn_down_exps.bias"])
    return model


def fp16_biases(model):
    """``model`` with its expert biases rounded to fp16 values (as bf16-published biases of ordinary size are)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                p.copy_(p.half().float())
    return model
