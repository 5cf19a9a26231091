"""Tiny ``deepseek2`` GGUF files written with gguf-py's GGUFWriter from the tests' tiny transformers DeepSeek-V2 / V3
models, as llama.cpp's converter (``DeepseekV2Model``) lays them out: MLA's ``kv_b_proj`` split into ``attn_k_b``
``[heads, R, nope]`` (transposed) and ``attn_v_b`` ``[heads, v, R]``, MLA as MQA (``head_count_kv`` 1, the
latent's sizes in ``key_length`` / ``value_length``, the per-head ones in ``*_mla``), the router by
``expert_gating_func``, YaRN's ``mscale_all_dim`` as ``yarn_log_multiplier = 0.1 * mscale_all_dim``, experts stacked
``[E, out, in]``; tensor names written out here (not taken from moeflow).

:func:`write_deepseek2_gguf` puts gguf-py's dequantization of every tensor written back into the transformers model
(kv_b joined back by :func:`join_kv_b`): the oracle moeflow's tokens on the file are compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf_models import T, _stored, add_test_vocab, gguf, nextn_tensors

ATTN = {"self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def split_kv_b(w: np.ndarray, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """The converter's split of kv_b_proj [heads * (nope + v), R]: (k_b [heads, R, nope], v_b [heads, v, R])."""
    kv = w.reshape(heads, -1, w.shape[-1])
    return np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv[:, nope:])


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def write_deepseek2_gguf(model, path: Path, expert_type=T.F32, other_type=T.F32, kv_b: str = "split",
                         nextn: dict | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` (a tiny transformers DeepseekV2/V3ForCausalLM) as a deepseek2 GGUF and replace its weights, in
    place, by what gguf-py dequantizes the file's bytes to. ``expert_type``: the stacked experts' ggml type;
    ``other_type``: the 2-D non-expert weights' whose rows allow it (norms, router, selection bias stay F32);
    ``kv_b``: "split" (``attn_k_b`` / ``attn_v_b``, today's converter) or "combined" (``attn_kv_b``, older ones).
    ``nextn``: the MTP layer's own tensors (tests/mtp_helpers.py's ``own``): ``model``'s last layer is its block,
    written as llama.cpp's ``Glm4MoeLiteModel`` does (``nextn_predict_layers`` 1, ``blk.N.nextn.*``); returns what
    gguf-py dequantizes them to by ``own``'s names (empty without)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    sigmoid = cfg.model_type == "deepseek_v3"
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group and cfg.n_group > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if kv_b == "split":
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:  # the converters before the MLA split: the per-head sizes in key_length / value_length
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if nextn is not None:
        w.add_nextn_predict_layers(1)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_test_vocab(w, cfg.vocab_size, "qwen2")

    written: dict[str, np.ndarray] = {}
    tensors: list[tuple[str, np.ndarray, object]] = []

    def put(name: str, t: np.ndarray, qtype=None) -> np.ndarray:
        if qtype is None:
            qtype = other_type if t.ndim >= 2 and "gate_inp" not in name and t.shape[-1] % 32 == 0 else T.F32
        data, deq = _stored(np.ascontiguousarray(t), qtype)
        tensors.append((name, data, qtype))
        return deq.reshape(t.shape)

    for hf, name in (("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                     ("lm_head.weight", "output.weight")):
        written[hf] = put(name, sd[hf])
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size  # noqa: E741
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        for module, gname in ATTN.items():
            if f"{p}.{module}.weight" in sd:
                written[f"{p}.{module}.weight"] = put(f"blk.{layer}.{gname}.weight", sd[f"{p}.{module}.weight"])
        kv = sd[f"{p}.self_attn.kv_b_proj.weight"]
        if kv_b == "split":
            k_b, v_b = split_kv_b(kv, cfg.num_attention_heads, cfg.qk_nope_head_dim)
            written[f"{p}.self_attn.kv_b_proj.weight"] = join_kv_b(put(f"blk.{layer}.attn_k_b.weight", k_b),
                                                                   put(f"blk.{layer}.attn_v_b.weight", v_b))
        else:
            written[f"{p}.self_attn.kv_b_proj.weight"] = put(f"blk.{layer}.attn_kv_b.weight", kv)
        if f"{p}.mlp.gate.e_score_correction_bias" in sd:
            written[f"{p}.mlp.gate.e_score_correction_bias"] = put(f"blk.{layer}.exp_probs_b.bias",
                                                                   sd[f"{p}.mlp.gate.e_score_correction_bias"])
        fused = sd.get(f"{p}.mlp.experts.gate_up_proj")
        if fused is None:
            continue
        deq = {proj: put(f"blk.{layer}.ffn_{proj}_exps.weight", t, expert_type)
               for proj, t in (("gate", fused[:, :I]), ("up", fused[:, I:]),
                               ("down", sd[f"{p}.mlp.experts.down_proj"]))}
        written[f"{p}.mlp.experts.gate_up_proj"] = np.concatenate([deq["gate"], deq["up"]], axis=1)
        written[f"{p}.mlp.experts.down_proj"] = deq["down"]
        assert written[f"{p}.mlp.experts.down_proj"].shape[0] == E
    own: dict[str, np.ndarray] = {}
    if nextn is not None:
        more, own = nextn_tensors(cfg.num_hidden_layers - 1, nextn, sd, other_type)
        tensors += more
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name in written:
                t.copy_(torch.from_numpy(np.ascontiguousarray(written[name])).reshape(t.shape))
    return own


def reference_from_deepseek2_file(model, path: Path):
    """``model`` (a tiny transformers DeepseekV2/V3ForCausalLM) with every weight replaced, in place, by gguf-py's
    dequantization of the deepseek2 GGUF at ``path`` (any writer: llama.cpp's converter and llama-quantize too)."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    stored = {t.name: dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
              for t in reader.tensors}
    cfg, written = model.config, {"model.embed_tokens.weight": stored["token_embd.weight"],
                                  "model.norm.weight": stored["output_norm.weight"],
                                  "lm_head.weight": stored["output.weight"]}
    I = cfg.moe_intermediate_size  # noqa: E741
    for layer in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{layer}", f"blk.{layer}"
        for module, gname in ATTN.items():
            if f"{b}.{gname}.weight" in stored:
                written[f"{p}.{module}.weight"] = stored[f"{b}.{gname}.weight"]
        written[f"{p}.self_attn.kv_b_proj.weight"] = (
            join_kv_b(stored[f"{b}.attn_k_b.weight"], stored[f"{b}.attn_v_b.weight"])
            if f"{b}.attn_k_b.weight" in stored else stored[f"{b}.attn_kv_b.weight"])
        if f"{b}.exp_probs_b.bias" in stored:
            written[f"{p}.mlp.gate.e_score_correction_bias"] = stored[f"{b}.exp_probs_b.bias"]
        if f"{b}.ffn_gate_exps.weight" in stored:
            written[f"{p}.mlp.experts.gate_up_proj"] = np.concatenate(
                [stored[f"{b}.ffn_gate_exps.weight"], stored[f"{b}.ffn_up_exps.weight"]], axis=1)
            written[f"{p}.mlp.experts.down_proj"] = stored[f"{b}.ffn_down_exps.weight"]
            assert written[f"{p}.mlp.experts.down_proj"].shape[-1] == I
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name in written:
                t.copy_(torch.from_numpy(np.ascontiguousarray(written[name], dtype=np.float32)).reshape(t.shape))
            elif not name.endswith("rotary_emb.inv_freq"):
                raise AssertionError(f"{name} is not in {path}")
    return model
