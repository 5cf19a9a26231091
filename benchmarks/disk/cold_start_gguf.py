"""A Q4_0 GGUF of the same shapes as disk/cold_start.py's AWQ slice, for llama.cpp's load time beside moeflow's.

llama.cpp's "llama" architecture with 8 experts (its Mixtral form: stacked ``ffn_*_exps``), Q4_0 weights (4.5 bits
per weight where the AWQ slice has ~4.16), fp16 embeddings and output as in the slice, a placeholder vocabulary of
the slice's size. The weight bytes are random (reused across experts, as the AWQ writer does): only loading and
the first token are timed, on the same token ids for both. Written with the ``gguf`` package's ``GGUFWriter``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (fp16 scale + 16 bytes of nibbles)


def _q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """uint8 ``[rows, cols/32*18]``: Q4_0 blocks with small finite scales and random nibbles."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.full(1, 1e-3, dtype=np.float16).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_q4_0_gguf(path: Path, config: dict, seed: int = 0) -> Path:
    """The GGUF at ``path`` (reused when it exists); config: disk/cold_start.py's Mixtral config dict."""
    import gguf

    if path.is_file():
        return path
    H, I, L, E = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], \
        config["num_local_experts"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    V = max(config["vocab_size"], 512)  # room for the 256 byte tokens (the tiny model's 97 is raised)
    kv = kv_heads * (H // heads)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(H // heads)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("llama")
    # <unk> <s> </s>, the 256 byte tokens (SentencePiece's byte fallback: any prompt tokenizes), placeholders
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
                     + [f"t{i}".encode() for i in range(259, V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (V - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    q4 = gguf.GGMLQuantizationType.Q4_0
    f16 = (rng.standard_normal((V, H)) * 0.02).astype(np.float16)
    w.add_tensor("token_embd.weight", f16)
    w.add_tensor("output.weight", f16.copy())
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    experts = {name: np.stack([_q4_0(rng, rows, cols) for _ in range(E)]) for name, rows, cols in
               (("ffn_gate_exps", I, H), ("ffn_up_exps", I, H), ("ffn_down_exps", H, I))}
    attention = {name: _q4_0(rng, rows, H) for name, rows in (("attn_q", H), ("attn_k", kv), ("attn_v", kv),
                                                                ("attn_output", H))}
    for layer in range(L):
        p = f"blk.{layer}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate_inp.weight", (rng.standard_normal((E, H)) * 0.02).astype(np.float32))
        for name, t in attention.items():
            w.add_tensor(f"{p}.{name}.weight", t, raw_dtype=q4)  # shape from the bytes per row
        for name, t in experts.items():
            w.add_tensor(f"{p}.{name}.weight", t, raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path
