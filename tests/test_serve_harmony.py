"""`moeflow serve` on a tiny gpt-oss that answers in harmony, driven by the official openai client.

The checkpoint (tests/harmony_helpers.py) is a transformers GptOssForCausalLM trained until greedy decoding of two
conversations writes an analysis message then a final answer (``<|return|>``), or an analysis message then a tool
call (``<|call|>``). At temperature 0 the server's reply is single-request greedy ``generate`` on the same
templated prompt, split by channel: ``message.content`` the final channel, ``reasoning_content`` the analysis,
``tool_calls`` the call; streamed or not. The prompt's date is pinned through ``chat_template_kwargs``.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from harmony_helpers import DATE, GREETING, WEATHER, WEATHER_TOOL, make_harmony_checkpoint
from serve_helpers import Server

from moeflow import MoEModel
from moeflow.chat.harmony import harmony_tokens, split_reply
from moeflow.chat.template import ChatTemplate, stop_token_ids

NAME = "tiny-gpt-oss"
KWARGS = {"chat_template_kwargs": {"current_date": DATE}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_harmony_checkpoint(tmp_path_factory.mktemp("harmony_gpt_oss"))


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = Server("--model", str(checkpoint), "--served-model-name", NAME, "--max-model-len", "400",
                 "--prefill-chunk", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(model, stop ids): greedy generate on the checkpoint, as the server runs it."""
    model = MoEModel.from_pretrained(checkpoint)
    tok = model.tokenizer
    stops = list(stop_token_ids(ChatTemplate.from_directory(checkpoint), model.generation_config.eos_ids(),
                                tok.encode))
    return model, stops


def greedy_reply(reference, messages, tools=None, max_new_tokens=80):
    model, stops = reference
    tok = model.tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools, current_date=DATE)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops)[0, len(ids):].tolist()
    return split_reply(out, harmony_tokens(tok), tok.decode), out, len(ids)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_the_reference_writes_harmony(reference):
    """The fixture's premise: greedy decoding really writes analysis + final (else the server tests are vacuous)."""
    reply, out, _ = greedy_reply(reference, GREETING)
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("User greets. Greet back.", "Hello, friend!", [])
    tok = reference[0].tokenizer
    assert out[-1] == tok.token_id("<|return|>") and tok.token_id("<|end|>") in out  # <|end|> did not stop it


def test_chat_splits_analysis_from_the_answer(server, reference):
    want, out, n_prompt = greedy_reply(reference, GREETING)
    r = client(server).chat.completions.create(model=NAME, messages=GREETING, temperature=0, max_tokens=80,
                                               extra_body=KWARGS)
    msg = r.choices[0].message
    assert msg.content == want.content == "Hello, friend!"
    assert msg.reasoning_content == want.reasoning
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(out))


def test_streamed_chat_splits_the_same_way(server, reference):
    want, _, _ = greedy_reply(reference, GREETING)
    content, reasoning, finish = [], [], None
    for chunk in client(server).chat.completions.create(model=NAME, messages=GREETING, temperature=0,
                                                        max_tokens=80, stream=True, extra_body=KWARGS):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            finish = choice.finish_reason or finish
    assert "".join(content) == want.content and "".join(reasoning) == want.reasoning
    assert len([r for r in reasoning if r]) > 1  # it streamed, token by token
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call(server, reference, stream):
    want, _, _ = greedy_reply(reference, WEATHER, tools=[WEATHER_TOOL])
    assert [(c.name, c.arguments) for c in want.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    c = client(server)
    args = dict(model=NAME, messages=WEATHER, tools=[WEATHER_TOOL], temperature=0, max_tokens=80, extra_body=KWARGS)
    if not stream:
        r = c.chat.completions.create(**args)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.reasoning_content == want.reasoning and not msg.content
        calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    else:
        calls, finish = [], None
        for chunk in c.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                calls += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls or []]
                finish = choice.finish_reason or finish
        assert finish == "tool_calls"
    assert calls == [("get_weather", '{"city":"Paris"}')]
    json.loads(calls[0][1])


def test_prior_reasoning_sent_back_is_dropped_and_effort_reaches_the_prompt(server, reference):
    """A client sends the previous turn back with its reasoning_content: harmony drops it, so the prompt (and
    the usage) is that of the conversation without it; reasoning_effort changes the system message."""
    turn = GREETING + [{"role": "assistant", "content": "Hello, friend!", "reasoning_content": "User greets."},
                       {"role": "user", "content": "Hello there!"}]
    tok = reference[0].tokenizer
    plain = [m if m["role"] != "assistant" else {"role": "assistant", "content": m["content"]} for m in turn]
    c = client(server)
    r = c.chat.completions.create(model=NAME, messages=turn, temperature=0, max_tokens=1, extra_body=KWARGS)
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(plain, add_generation_prompt=True, current_date=DATE))
    low = c.chat.completions.create(model=NAME, messages=GREETING, temperature=0, max_tokens=1,
                                    reasoning_effort="low", extra_body=KWARGS)
    want = tok.apply_chat_template(GREETING, add_generation_prompt=True, current_date=DATE, reasoning_effort="low")
    medium = tok.apply_chat_template(GREETING, add_generation_prompt=True, current_date=DATE)
    assert len(want) != len(medium)  # "low" and "medium" tokenize to different lengths here: the check can fail
    assert low.usage.prompt_tokens == len(want)


def test_chat_cli_streams_thinking_then_the_answer(reference):
    """`moeflow chat` / `generate --chat` print through ReplyStreamer: the analysis marked, then the answer."""
    import io

    from moeflow.cli.serve import ReplyStreamer, reply_assembler

    model, stops = reference
    tok = model.tokenizer
    ids = tok.apply_chat_template(GREETING, add_generation_prompt=True, current_date=DATE)
    out = io.StringIO()
    split = reply_assembler(tok, tuple(stops), tok.decode(ids, skip_special_tokens=False))
    model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False, eos_token_id=stops,
                   streamer=ReplyStreamer(split.reply, stream=out))
    assert out.getvalue() == "(thinking) User greets. Greet back.\nHello, friend!\n"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_answer_not_the_reasoning(server, stream):
    """"Greet" occurs in the reasoning ("Greet back."): only the final channel is searched for stop strings."""
    args = dict(model=NAME, messages=GREETING, temperature=0, max_tokens=80, stop=["friend", "Greet"],
                extra_body=KWARGS)
    c = client(server)
    if not stream:
        r = c.chat.completions.create(**args)
        content, reasoning, finish = r.choices[0].message.content, r.choices[0].message.reasoning_content, \
            r.choices[0].finish_reason
    else:
        parts, thoughts, finish = [], [], None
        for chunk in c.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                thoughts.append(getattr(choice.delta, "reasoning_content", None) or "")
                finish = choice.finish_reason or finish
        content, reasoning = "".join(parts), "".join(thoughts)
    assert (content, reasoning, finish) == ("Hello, ", "User greets. Greet back.", "stop")
