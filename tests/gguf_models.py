"""Tiny GGUF files written with gguf-py's GGUFWriter from the tests' tiny transformers models, as llama.cpp's
converter lays them out: llama.cpp tensor names (written out here, not taken from moeflow), experts stacked
``[E, out, in]``, the ``llama`` architecture's q/k rows permuted for GGML's rotary (``convert_hf_to_gguf.py``'s
``LlamaModel.permute``), a byte-level BPE vocabulary of the model's size and a chat template in the metadata.

``reference_model`` returns the same transformers model with every weight replaced by gguf-py's own dequantization
of the bytes written: the oracle moeflow's tokens on the GGUF are compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

T = gguf.GGMLQuantizationType
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "glm4_moe": "glm4moe",
        "minimax_m2": "minimax-m2"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q with the attention heads, k with the kv heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(model) -> dict[str, str]:
    """HF state-dict name -> llama.cpp tensor name, for the non-expert tensors of ``model``."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
                 "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                 "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                 "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                 "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name in model.state_dict():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or ".experts." in name:
            continue
        if name.endswith(("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")):  # exp_probs_b
            out[name] = f"blk.{parts[2]}.exp_probs_b.bias"
            continue
        module, suffix = ".".join(parts[3:-1]), parts[-1]
        gguf_module = per_layer[module]
        if model.config.model_type == "glm4_moe" and module == "post_attention_layernorm":
            gguf_module = "post_attention_norm"  # llama.cpp's glm4moe has no ffn_norm
        out[name] = f"blk.{parts[2]}.{gguf_module}.{suffix}"
    return out


def _vocab(size: int) -> tuple[list[str], list[int]]:
    """Byte-level BPE: the bytes from the space on, one merge ("a b" -> "ab"), three special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [c for _, c in sorted(bytes_to_unicode().items())]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = chars[32:32 + size - len(specials) - 1] + ["ab"] + specials
    return tokens, [1] * (size - len(specials)) + [3] * len(specials)


def add_test_vocab(w: gguf.GGUFWriter, vocab_size: int, pre: str) -> None:
    """The tests' byte-level BPE vocabulary (``pre``: llama.cpp's pre-tokenizer name), special ids and chat template."""
    tokens, types = _vocab(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(vocab_size - 1)
    w.add_bos_token_id(vocab_size - 3)
    w.add_chat_template(CHAT_TEMPLATE)


def _stored(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes or values to write, what gguf-py dequantizes them to in fp32)."""
    if qtype == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = quantize(w.astype(np.float32), qtype)
    return data, dequantize(data, qtype)


def write_gguf(model, path: Path, expert_types=T.Q8_0, other_type=T.F32, split: int = 1,
               raw_experts: dict | None = None, types_by_suffix: dict | None = None,
               raw_tensors: dict | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` (a tiny transformers MoE) as a GGUF file (``split`` > 1: a split set, ``path`` its first
    part). ``expert_types``: one ggml type, or one per layer; ``other_type``: the 2-D non-expert weights' (norms and
    the router stay F32, as llama.cpp writes them). ``raw_experts``: {(layer, "gate"|"up"|"down"): uint8 bytes
    [E, out, row_bytes], type} written instead (hand-made K-quant blocks). ``types_by_suffix``: {GGUF name suffix
    (``"attn_k.weight"``): type} in place of ``other_type`` (llama.cpp's Q8_0 k / v beside Q4_0). ``raw_tensors``:
    {GGUF name (``"output.weight"``): (uint8 bytes [rows, row_bytes], type)} written instead of the model's
    values (a hand-made Q6_K lm_head). Returns every
    tensor as gguf-py dequantizes it, by HF name (experts: ``layers.L.{gate,up,down}`` [E, out, in])."""
    cfg = model.config
    kind = cfg.model_type
    arch = ARCH[kind]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = gguf_names(model)
    writers = [gguf.GGUFWriter(_part(path, i, split), arch) for i in range(split)]
    w = writers[0]
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    E = getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    inter = cfg.moe_intermediate_size if kind in ("qwen3_moe", "qwen2_moe", "glm4_moe") else cfg.intermediate_size
    w.add_block_count(L)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                         else cfg.rope_theta)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind not in ("mixtral", "minimax_m2"):
        w.add_expert_feed_forward_length(inter)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if kind == "minimax_m2":  # as llama.cpp's MiniMaxM2Model.set_gguf_parameters writes them
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if kind == "glm4_moe":  # as llama.cpp's Glm4MoeModel.set_gguf_parameters writes them
        head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    add_test_vocab(w, cfg.vocab_size, "qwen2")
    for i, part in enumerate(writers):
        if split > 1:
            part.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, i)
            part.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, split)
    written: dict[str, np.ndarray] = {}
    tensors: list[tuple[str, np.ndarray, object]] = []
    for hf, name in names.items():
        t = sd[hf]
        if kind == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = permute(t, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp stores Qwen2-MoE's [1, H] shared gate as [H]
            t = t.reshape(-1)
        qtype = other_type if t.ndim == 2 and "gate_inp" not in name and t.shape[-1] % 32 == 0 else T.F32
        qtype = next((q for suffix, q in (types_by_suffix or {}).items() if name.endswith(suffix)), qtype)
        if raw_tensors and name in raw_tensors:
            data, qtype = raw_tensors[name]
            written[hf] = dequantize(data, qtype)
            tensors.append((name, data, qtype))
            continue
        data, deq = _stored(t, qtype)
        if kind == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):  # back to HF's row order
            n = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        written[hf] = deq
        tensors.append((name, data, qtype))
    for layer in range(L):
        fused, down = sd.get(f"model.layers.{layer}.mlp.experts.gate_up_proj"), None
        if fused is None:
            continue
        down = sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        qtype = expert_types[layer] if isinstance(expert_types, (list, tuple)) else expert_types
        for proj, t in (("gate", fused[:, :inter]), ("up", fused[:, inter:]), ("down", down)):
            if raw_experts and (layer, proj) in raw_experts:
                data, rtype = raw_experts[(layer, proj)]
                deq = dequantize(data, rtype)
                tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", data, rtype))
            else:
                data, deq = _stored(np.ascontiguousarray(t), qtype)
                tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", data, qtype))
            written[f"layers.{layer}.{proj}"] = deq
    for i, (name, data, qtype) in enumerate(tensors):
        writers[i * split // len(tensors)].add_tensor(name, data, raw_dtype=qtype)
    for part in writers:
        part.write_header_to_file()
        part.write_kv_data_to_file()
        part.write_tensors_to_file()
        part.close()
    return written


def random_k_experts(kind: str, num_experts: int, out: int, seed: int, inp: int = 256) -> np.ndarray:
    """Hand-made stacked expert blocks uint8 [E, out, row_bytes] of ``kind`` (Q4_0, Q4_K, Q5_K, Q6_K, MXFP4; gguf-py
    cannot quantize to the K-quants): random bytes, with the fp16 scales (or MXFP4's exponents) set so the weights
    come out around 0.1, as a trained model's."""
    qtype = getattr(T, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n = num_experts * out * (inp // block)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)

    def half(scale: float) -> np.ndarray:
        return np.abs(rng.normal(scale, scale / 4, n)).astype(np.float16).view(np.uint8).reshape(n, 2)

    if kind in ("Q4_K", "Q5_K"):  # d * sc * q - dmin * m, sc, m < 64, q < 16 (32)
        raw[:, 0:2], raw[:, 2:4] = half(0.2 / (63 * (15 if kind == "Q4_K" else 31))), half(0.1 / (63 * 8))
    elif kind == "Q6_K":  # d * scale * (q - 32), |scale| <= 128
        raw[:, 208:210] = half(0.2 / (128 * 32))
    elif kind == "Q4_0":  # d * (q - 8), q < 16
        raw[:, 0:2] = half(0.2 / 8)
    elif kind == "MXFP4":  # 2^(e - 128) * e2m1 value up to 12
        raw[:, 0] = rng.integers(121, 124, n)
    return raw.reshape(num_experts, out, -1)


def k_mix_experts(mix: list[tuple[str, str]], num_experts: int, hidden: int, inter: int) -> dict:
    """``write_gguf``'s ``raw_experts`` for a mix of block types per layer: mix[layer] = (gate/up type, down type),
    e.g. Q4_K_M's [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ...] (hand-made blocks, :func:`random_k_experts`)."""
    return {(layer, proj): (random_k_experts(kinds[proj == "down"], num_experts, hidden if proj == "down" else inter,
                                             10 * layer + seed, inter if proj == "down" else hidden),
                            getattr(T, kinds[proj == "down"]))
            for layer, kinds in enumerate(mix) for seed, proj in enumerate(("gate", "up", "down"))}


def _part(path: Path, i: int, split: int) -> Path:
    if split == 1:
        return path
    stem = path.name.split("-00001-of-")[0]
    return path.with_name(f"{stem}-{i + 1:05d}-of-{split:05d}.gguf")


def reference_model(model, written: dict[str, np.ndarray]):
    """``model`` with every weight replaced by the GGUF's values (gguf-py's dequantization), in place."""
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in written:
                p.copy_(torch.tensor(written[name]).reshape(p.shape))
            elif name.endswith("experts.gate_up_proj"):
                layer = name.split(".")[2]
                inter = written[f"layers.{layer}.gate"].shape[1]
                p[:, :inter].copy_(torch.from_numpy(written[f"layers.{layer}.gate"]))
                p[:, inter:].copy_(torch.from_numpy(written[f"layers.{layer}.up"]))
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.from_numpy(written[f"layers.{name.split('.')[2]}.down"]))
    return model


def reference_from_file(model, path: Path):
    """``model`` (a tiny transformers MoE) with every weight replaced, in place, by gguf-py's dequantization of the
    GGUF file at ``path`` (any writer: llama.cpp's converter and llama-quantize too), names mapped by
    :func:`gguf_names`, the ``llama`` architecture's q/k rows permuted back."""
    reader = gguf.GGUFReader(path)
    stored = {t.name: dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
              for t in reader.tensors}
    cfg, written = model.config, {}
    for hf, name in gguf_names(model).items():
        if name not in stored:  # tied embeddings: no output.weight
            continue
        t = stored[name]
        if cfg.model_type == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            t = t.reshape(n, t.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(t.shape)
        written[hf] = t
    for layer in range(cfg.num_hidden_layers):
        for proj in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            if name in stored:
                written[f"layers.{layer}.{proj}"] = stored[name]
    return reference_model(model, written)
