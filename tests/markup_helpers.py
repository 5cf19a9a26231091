"""A tiny Qwen3-MoE that thinks in ``<think>`` and calls tools in Hermes markup (``<tool_call>{json}</tool_call>``),
trained locally until greedy decoding writes its two learned replies: test material for the server's reply split.

The tokenizer marks ``<tool_call>`` / ``</tool_call>`` special (some vocabularies do) and ``<think>`` / ``</think>``
as ordinary added tokens (Qwen3's), so both ways a tag can reach the text are exercised."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from family_models import make_family_model
from harmony_helpers import train_replies

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
ADDED = ["<think>", "</think>"]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- else %}{{ m.content or '' }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{%- endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREETING = [{"role": "user", "content": "Hello there!"}]
GREETING_REPLY = "User greets.\n</think>\n\nHello, friend!<|im_end|>"
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_REPLY = ('Use the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 "</tool_call><|im_end|>")


def render(messages: list[dict], tools: list[dict] | None = None) -> str:
    from jinja2 import Environment

    return Environment().from_string(TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=True)


def make_markup_checkpoint(directory: Path, steps: int = 400) -> Path:
    """The checkpoint (fp32 Qwen3-MoE, tokenizer.json, chat template) whose greedy replies to GREETING and
    WEATHER (with WEATHER_TOOL) are GREETING_REPLY and WEATHER_REPLY."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moeflow.io.tokenizer import Tokenizer as MoeflowTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    prompts = [render(GREETING), render(WEATHER, [WEATHER_TOOL])]
    texts = [prompts[0] + GREETING_REPLY, prompts[1] + WEATHER_REPLY]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts * 4, trainer)
    tok.add_tokens(ADDED)
    tok.save(str(directory / "tokenizer.json"))
    mtok = MoeflowTokenizer(directory / "tokenizer.json")
    seqs = [torch.tensor([mtok.encode(t, add_special_tokens=False)]) for t in texts]
    starts = [len(mtok.encode(p, add_special_tokens=False)) for p in prompts]
    model = make_family_model("qwen3_moe", seed=0, vocab_size=mtok.vocab_size, max_position_embeddings=512)
    model = train_replies(model, seqs, starts, steps, "markup")
    end, pad = mtok.token_id("<|im_end|>"), mtok.token_id("<|endoftext|>")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [end, pad], pad
    model.config.eos_token_id = end
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return directory
