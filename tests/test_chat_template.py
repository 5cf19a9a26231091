"""Chat templates: where they come from, rendering as transformers does, and `generate --chat` / `chat`."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.chat.template import ChatTemplate, ChatTemplateError, chat_template_for
from moeflow.cli import embedded_model_path, main
from moeflow.errors import CheckpointError
from moeflow.io.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is a module? (é)"},
            {"role": "assistant", "content": "A file of Python code."},
            {"role": "user", "content": "And a package?"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a name in the docs",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_embedded_template_matches_transformers():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    ours = Tokenizer(embedded_model_path() / "tokenizer.json")
    for tools in (None, TOOLS):
        for gen_prompt in (False, True):
            want_text = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen_prompt,
                                               tokenize=False)
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt, tools=tools,
                                            tokenize=False) == want_text
            want_ids = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen_prompt,
                                              tokenize=True, return_dict=False)
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt, tools=tools) == want_ids
    # the end of turn is one byte-level special token, the generation_config's EOS
    assert hf.eos_token_id == 3 and len(hf) == 256
    assert ours.decode([65, 3, 66]) == "AB"


def test_raise_exception_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="narrator"):
        chat_template_for(embedded_model_path()).render([{"role": "narrator", "content": "x"}])


def test_template_sources_and_selection(tmp_path):
    assert ChatTemplate.from_directory(tmp_path) is None
    with pytest.raises(CheckpointError, match="ships no chat template"):
        chat_template_for(tmp_path)
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": [{"name": "default", "template": "{{ bos_token }}D{{ messages|length }}"},
                                {"name": "tool_use", "template": "T{{ tools[0].function.name }}{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = ChatTemplate.from_directory(tmp_path)
    assert t.render(MESSAGES) == "<s>D4"
    assert t.render(MESSAGES, tools=TOOLS) == "Tlookup</s>"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers; a block tag's newline is trimmed
    # (the expected text is what transformers renders for this template)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n  [{{ m.role }}]\n{% endfor %}\n"
                                                  "{{ extra }}{{ messages[0] | tojson }}")
    rendered = ChatTemplate.from_directory(tmp_path).render(MESSAGES[:1], extra="!")
    assert rendered == '  [system]\n!{"role": "system", "content": "Answer briefly."}'


@pytest.mark.parametrize("lookup", [[], ["--prompt-lookup", "4"]])
def test_generate_chat_prints_the_greedy_reply(capsys, lookup):
    """Also with prompt lookup decoding, whose passes stream several tokens at once (drafts kept, counted)."""
    from serve_helpers import Reference

    ref = Reference()
    want, _ = ref.greedy(ref.chat_ids([{"role": "user", "content": "What is a module?"}]), 40)
    assert main(["generate", "--model", str(embedded_model_path()), "--chat", "--prompt", "What is a module?",
                 "--greedy", "--max-new-tokens", "40", "--device", "cpu", *lookup]) == 0
    out = capsys.readouterr().out
    assert out.startswith(want + "\n")
    assert ("drafts" in out and "accepted" in out) == bool(lookup)


def test_chat_command_keeps_the_conversation(monkeypatch, capsys):
    lines = iter(["What is a module?", "/reset", "And a package?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--greedy", "--max-new-tokens", "6", "--device", "cpu", "--system", "Be brief."]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2


def test_the_chat_streamer_takes_several_tokens_per_put():
    """Prompt lookup decoding hands ``[1, k]`` tokens per pass; one-token steps hand ``[batch]``."""
    import io
    from types import SimpleNamespace

    from moeflow.cli.serve import ReplyStreamer

    def split(ids, final):
        return SimpleNamespace(reasoning="", content="".join(chr(i) for i in ids), tool_calls=[])

    out = io.StringIO()
    streamer = ReplyStreamer(split, stream=out)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    streamer.put(torch.tensor([ord("a")]))
    streamer.put(torch.tensor([[ord("b"), ord("c"), ord("d")]]))
    streamer.end()
    assert out.getvalue() == "abcd\n"
