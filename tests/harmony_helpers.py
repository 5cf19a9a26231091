"""Harmony (gpt-oss chat format) test material made locally: OpenAI's openai-harmony renderer with the o200k
vocabulary rebuilt from a PyPI package, a small BPE tokenizer with the harmony special tokens, and a tiny
transformers GptOssForCausalLM trained to answer two prompts in harmony (so greedy decoding writes real
analysis / final / tool-call messages)."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import struct
from pathlib import Path

import torch
from gpt_oss_helpers import make_gpt_oss_model

from moeflow.chat.template import harmony_template

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony checks it
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
            "<|constrain|>"]
DATE = "2026-11-23"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# the two conversations the tiny model learns, and the reply (after <|start|>assistant) it learns for each
GREETING = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there!"}]
GREETING_REPLY = ("<|channel|>analysis<|message|>User greets. Greet back.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello, friend!<|return|>")
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_REPLY = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.get_weather"
                 '<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>')


def o200k_dir(root: Path) -> Path:
    """A folder with o200k_base.tiktoken (for TIKTOKEN_ENCODINGS_BASE), rebuilt from the vocabulary the
    quicktok-v1 package ships: records (u16 length, bytes, u32 rank) after a u32 count, written back as the
    tiktoken text format (base64 token, space, rank). openai-harmony refuses it unless its sha256 is OpenAI's."""
    spec = importlib.util.find_spec("quicktok")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    raw = data.read_bytes()
    (count,), offset, ranks = struct.unpack_from("<I", raw), 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, offset)
        token = raw[offset + 2: offset + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, offset + 2 + length)
        ranks.append((rank, token))
        offset += 2 + length + 4
    root.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in sorted(ranks))
    (root / "o200k_base.tiktoken").write_text(text)
    return root


def harmony_encoding(root: Path):
    """openai-harmony's gpt-oss encoding, its vocabulary read from ``root`` (no download)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(o200k_dir(root))  # read once, while loading
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    return harmony_template().render(messages, add_generation_prompt, tools=tools, current_date=DATE)


def make_harmony_tokenizer(path: Path, corpus: list[str]):
    """A byte-level BPE tokenizer.json (~400 entries) trained on ``corpus`` with the harmony special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return tok


def make_harmony_checkpoint(directory: Path, steps: int = 400) -> Path:
    """A tiny gpt-oss (fp32) with a harmony tokenizer, trained until greedy decoding of GREETING and WEATHER
    (rendered by moeflow's harmony template, today's date pinned) writes GREETING_REPLY and WEATHER_REPLY."""
    from moeflow.io.tokenizer import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    prompts = [render(GREETING), render(WEATHER, tools=[WEATHER_TOOL])]
    texts = [prompts[0] + GREETING_REPLY, prompts[1] + WEATHER_REPLY]
    make_harmony_tokenizer(directory / "tokenizer.json", texts * 4 + ["Hello, friend! Paris weather tool city."])
    tok = Tokenizer(directory / "tokenizer.json")
    seqs = [torch.tensor([tok.encode(t, add_special_tokens=False)]) for t in texts]
    starts = [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    model = make_gpt_oss_model(seed=0, vocab_size=tok.vocab_size, sliding_window=128, max_position_embeddings=512)
    model = train_replies(model, seqs, starts, steps, "harmony")
    ids = {t: tok.token_id(t) for t in SPECIALS}
    model.generation_config.eos_token_id = [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.config.eos_token_id = ids["<|return|>"]
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>",
                                                                 "pad_token": "<|endoftext|>"}))
    return directory


def train_replies(model, seqs: list[torch.Tensor], starts: list[int], steps: int, what: str):
    """``model`` (a transformers causal LM) trained on ``seqs`` [1, T] until greedy decoding of each prompt
    (its first ``starts[i]`` tokens) writes the rest: the loss on the replies only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other (10-50x slower on a busy machine)
    try:
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        labels = [s.masked_fill(torch.arange(s.shape[1]) < n, -100) for s, n in zip(seqs, starts, strict=True)]
        for step in range(steps):
            opt.zero_grad()
            loss = sum(model(input_ids=s, labels=y).loss for s, y in zip(seqs, labels, strict=True))
            loss.backward()
            opt.step()
            if step % 20 == 19 and _memorized(model, seqs, starts):
                break
        assert _memorized(model, seqs, starts), f"the tiny model did not learn its {what} replies"
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


@torch.no_grad()
def _memorized(model, seqs: list[torch.Tensor], starts: list[int]) -> bool:
    model.eval()
    try:
        for s, n in zip(seqs, starts, strict=True):
            out = model.generate(s[:, :n], attention_mask=torch.ones_like(s[:, :n]), max_new_tokens=s.shape[1] - n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            if not torch.equal(out, s):
                return False
        return True
    finally:
        model.train()
