"""The harmony chat format of gpt-oss: moeflow's template renders what OpenAI's openai-harmony renders (text and
o200k token stream), moeflow's reply splitter reads what openai-harmony's parser reads, and the stop tokens
are the turn ends ``<|return|>`` / ``<|call|>`` (never ``<|end|>``, which only ends the analysis message)."""

from __future__ import annotations

import json

import openai_harmony as oh  # the test extra: OpenAI's own harmony renderer and parser
import pytest
from harmony_helpers import DATE, WEATHER_TOOL, harmony_encoding, render

from moeflow.chat.harmony import HarmonyTokens, split_reply
from moeflow.chat.template import ChatTemplate, harmony_template, stop_token_ids

TOOLS = [
    WEATHER_TOOL,
    {"type": "function", "function": {"name": "noargs", "description": "Takes nothing.\nReturns the time."}},
    {"type": "function", "function": {"name": "many", "description": "Every simple type.", "parameters": {
        "type": "object", "required": ["n"], "properties": {
            "n": {"type": "integer", "description": "how many", "default": 3}, "f": {"type": "number"},
            "b": {"type": "boolean"}, "e": {"type": "string", "enum": ["c", "f"]},
            "arr": {"type": "array", "items": {"type": "string"}}, "u": {"type": ["string", "null"]}}}}},
]
CALL_ARGS = '{"city":"Paris"}'


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return harmony_encoding(tmp_path_factory.mktemp("o200k"))


def M(role: str, content, channel: str | None = None, recipient: str | None = None, ctype: str | None = None):
    msg = oh.Message.from_role_and_content(role, content)
    if channel:
        msg = msg.with_channel(channel)
    if recipient:
        msg = msg.with_recipient(recipient)
    if ctype:
        msg = msg.with_content_type(ctype)
    return msg


def theirs(enc, messages, instructions=None, tools=None, effort="medium", generation=True) -> list[int]:
    """openai-harmony's rendering: system (date, effort), developer (instructions, function tools), messages."""
    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
    head = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system.with_conversation_start_date(DATE))]
    if instructions or tools:
        dev = oh.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([oh.ToolDescription.new(
                t["function"]["name"], t["function"].get("description", ""), parameters=t["function"].get("parameters"))
                for t in tools])
        head.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    convo = oh.Conversation.from_messages(head + messages)
    config = oh.RenderConversationConfig(auto_drop_analysis=False)  # dropping is ours to get right: no help
    if generation:
        return enc.render_conversation_for_completion(convo, oh.Role.ASSISTANT, config=config)
    return enc.render_conversation(convo, config=config)


def assert_same(enc, ours_text: str, want: list[int]) -> None:
    assert ours_text == enc.decode_utf8(want)
    # the same token stream: our text read by the o200k tokenizer, the markup as special tokens
    assert enc.encode(ours_text, allowed_special="all") == want


def tool_call_message(content=None, reasoning=None):
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": CALL_ARGS}}]}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


CASES = {
    "user": ([{"role": "user", "content": "Hi"}], [M("user", "Hi")], {}),
    "system becomes developer instructions": (
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        [M("user", "Hi")], dict(instructions="Answer in French.")),
    "developer role, high effort": (
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [M("user", "Hi")], dict(instructions="Be brief.", effort="high")),
    "tools, low effort": ([{"role": "user", "content": "Hi"}], [M("user", "Hi")], dict(tools=TOOLS, effort="low")),
    "instructions and tools": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Hi"}],
        [M("user", "Hi")], dict(instructions="Use tools.", tools=TOOLS)),
    "multi-turn: finished turns lose their analysis": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4.", "reasoning_content": "Simple sum."},
         {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "6.", "thinking": "Again."},
         {"role": "user", "content": "Thanks"}],
        [M("user", "2+2?"), M("assistant", "4.", "final"), M("user", "And 3+3?"), M("assistant", "6.", "final"),
         M("user", "Thanks")], {}),
    "tool call in progress keeps its analysis; tool result": (
        [{"role": "user", "content": "Weather in Paris?"}, tool_call_message(reasoning="Use the tool."),
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'}],
        [M("user", "Weather in Paris?"), M("assistant", "Use the tool.", "analysis"),
         M("assistant", CALL_ARGS, "commentary", "functions.get_weather", "<|constrain|>json"),
         oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), '{"temp": 20}')
         .with_channel("commentary").with_recipient("assistant")],
        dict(tools=[WEATHER_TOOL])),
    "answered tool call: analysis dropped, preamble kept": (
        [{"role": "user", "content": "Weather?"}, tool_call_message(content="Checking.", reasoning="Tool."),
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}],
        [M("user", "Weather?"), M("assistant", "Checking.", "commentary"),
         M("assistant", CALL_ARGS, "commentary", "functions.get_weather", "<|constrain|>json"),
         oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), "sunny")
         .with_channel("commentary").with_recipient("assistant"),
         M("assistant", "Sunny.", "final"), M("user", "Thanks")],
        dict(tools=[WEATHER_TOOL])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_template_renders_what_openai_harmony_renders(enc, name):
    ours_messages, their_messages, kw = CASES[name]
    text = harmony_template().render(ours_messages, add_generation_prompt=True, tools=kw.get("tools"),
                                     reasoning_effort=kw.get("effort"), current_date=DATE)
    assert_same(enc, text, theirs(enc, their_messages, kw.get("instructions"), kw.get("tools"),
                                  kw.get("effort", "medium")))


def test_openai_harmonys_own_drop_rule_agrees_on_one_finished_turn(enc):
    """openai-harmony's auto_drop_analysis (its default) on [user, analysis, final, user]: our rendering of the
    OpenAI messages equals it."""
    convo = oh.Conversation.from_messages([
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new().with_conversation_start_date(DATE)),
        M("user", "2+2?"), M("assistant", "Sum.", "analysis"), M("assistant", "4.", "final"), M("user", "3+3?")])
    want = enc.render_conversation_for_completion(convo, oh.Role.ASSISTANT)
    text = render([{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4.", "reasoning_content": "Sum."},
                   {"role": "user", "content": "3+3?"}])
    assert_same(enc, text, want)


def test_last_assistant_message_ends_with_return_without_generation_prompt(enc):
    text = harmony_template().render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."}],
                                     add_generation_prompt=False, current_date=DATE)
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Hey.<|return|>")


@pytest.mark.parametrize("bad,match", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "one system or developer"),
    ([{"role": "critic", "content": "a"}], "unknown role critic"),
])
def test_refused_conversations_say_why(bad, match):
    with pytest.raises(Exception, match=match):
        render(bad)


def o200k_tokens(enc) -> HarmonyTokens:
    ids = {t: enc.encode(t, allowed_special="all")[0] for t in
           ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")}
    return HarmonyTokens(*ids.values())


def o200k_decode(enc):
    special = set(o200k_tokens(enc).__dict__.values())

    def decode(ids, skip_special_tokens=True):
        return enc.decode_utf8([i for i in ids if not (skip_special_tokens and i in special)])
    return decode


@pytest.mark.parametrize("reply", [
    [M("assistant", "Think é.", "analysis"), M("assistant", "Answer.", "final")],
    [M("assistant", "Need data.", "analysis"),
     M("assistant", CALL_ARGS, "commentary", "functions.get_weather", "<|constrain|>json")],
    [M("assistant", "Plan.", "analysis"), M("assistant", "More plan.", "analysis"), M("assistant", "Done.", "final")],
])
def test_split_reply_reads_what_openai_harmonys_parser_reads(enc, reply):
    """A reply as the model writes it (after the prompt's ``<|start|>assistant``), ending in <|return|> / <|call|>."""
    prompt = theirs(enc, [M("user", "Hi")])
    full = theirs(enc, [M("user", "Hi"), *reply], generation=False)
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt):]
    generated[-1] = o200k_tokens(enc).call if reply[-1].recipient else o200k_tokens(enc).ret
    parsed = enc.parse_messages_from_completion_tokens(generated, oh.Role.ASSISTANT)
    got = split_reply(generated, o200k_tokens(enc), o200k_decode(enc))
    text = lambda m: "".join(c.text for c in m.content)  # noqa: E731
    assert got.reasoning == "".join(text(m) for m in parsed if m.channel == "analysis")
    assert got.content == "".join(text(m) for m in parsed if m.channel == "final")
    calls = [(m.recipient.removeprefix("functions."), text(m)) for m in parsed if m.recipient]
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    assert got.content or got.tool_calls  # the cases are not vacuous
    # streaming: any prefix splits into a prefix of each field
    for n in range(len(generated)):
        part = split_reply(generated[:n], o200k_tokens(enc), o200k_decode(enc), final=False)
        assert got.reasoning.startswith(part.reasoning.rstrip("\ufffd"))
        assert got.content.startswith(part.content.rstrip("\ufffd"))


def test_stop_tokens_are_the_turn_ends(enc, tmp_path):
    template = harmony_template()

    def encode(text, add_special_tokens=False):
        return enc.encode(text, allowed_special="all")
    stops = stop_token_ids(template, [199999], encode)
    assert stops == (199999, 200002, 200012)  # <|endoftext|>, <|return|>, <|call|>; not <|end|> (200007)


def test_a_gpt_oss_checkpoint_without_template_gets_moeflows_harmony(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    template = ChatTemplate.from_directory(tmp_path)
    assert template is not None and template.source.endswith("harmony.jinja")
    assert template.special_tokens["eos_token"] == "<|return|>"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert ChatTemplate.from_directory(tmp_path) is None
