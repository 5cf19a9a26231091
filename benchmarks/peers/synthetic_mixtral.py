"""The synthetic Mixtral-architecture checkpoint of issue 21, written with transformers' ``save_pretrained``.

hidden 1024, intermediate 3584, 8 layers x 8 experts, top-2, 32 heads / 8 KV heads, vocab 32000: 791 M
parameters with random weights (transformers' own init, seeded), saved in bf16. llama.cpp's converter needs
a tokenizer, so a small sentencepiece model is trained here on the repository's own Markdown; the converter
pads its vocabulary with ``[PAD{i}]`` entries up to 32000. Nobody reads the tokens: every peer is timed on
the same random token ids.

    python -m benchmarks.peers.synthetic_mixtral OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
SP_VOCAB = 600


def train_tokenizer(out: Path) -> None:
    """A small sentencepiece (BPE) model trained on the repository's Markdown, saved as ``tokenizer.model``."""
    import sentencepiece as spm

    text = "\n".join(p.read_text(errors="ignore") for p in sorted(REPO.rglob("*.md")) if ".git" not in p.parts)
    corpus = out / "sp_corpus.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=SP_VOCAB, model_type="bpe",
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False,
    }, indent=1))


def write_checkpoint(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config, bf16 safetensors, generation config, tokenizer) into ``out``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file() and (out / "tokenizer.model").is_file():
        return out
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    train_tokenizer(out)
    return out


def parameter_count() -> int:
    """Parameters of the checkpoint, from its shapes (no model built)."""
    c = CONFIG
    h, i, v, e, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_local_experts"], \
        c["num_hidden_layers"]
    head = h // c["num_attention_heads"]
    attn = h * h * 2 + 2 * h * c["num_key_value_heads"] * head
    return 2 * v * h + h + n * (attn + e * 3 * h * i + e * h + 2 * h)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    print(write_checkpoint(ap.parse_args().out), f"{parameter_count() / 1e6:.0f} M parameters")
