"""`moeflow serve`'s prefix cache through the openai client: a conversation's second turn reuses the first turn's
prompt and reply (``usage.prompt_tokens_details.cached_tokens``, plain and streamed), its text is still greedy
generate's, and /metrics counts the hits, the reused tokens and the prompt tokens prefilled. ``--prefix-cache off``
reuses nothing."""

from __future__ import annotations

import httpx
import openai
import torch
from serve_helpers import MODEL_NAME, Reference, Server, metric

from moeflow.engine.prefix_cache import common_prefix

SYSTEM = {"role": "system", "content": "You answer questions about Python modules, briefly and exactly."}
TURN1 = {"role": "user", "content": "What does the import statement do?"}
TURN2 = {"role": "user", "content": "And what does from-import add?"}


def turn(c: openai.OpenAI, messages: list[dict], stream: bool) -> tuple[str, object]:
    """(reply text, usage) of one chat completion at temperature 0."""
    if not stream:
        r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.usage
    parts, usage = [], None
    for chunk in c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        parts.extend(ch.delta.content or "" for ch in chunk.choices)
    return "".join(parts), usage


def test_second_turn_reuses_the_first_and_reports_cached_tokens():
    ref = Reference()
    ids1 = ref.chat_ids([SYSTEM, TURN1])
    reply1 = ref.model.generate(torch.tensor([ids1]), max_new_tokens=12, do_sample=False,
                                eos_token_id=ref.stop_ids)[0, len(ids1):].tolist()
    text1 = ref.tokenizer.decode([t for t in reply1 if t not in ref.stop_ids])
    second = [SYSTEM, TURN1, {"role": "assistant", "content": text1}, TURN2]
    ids2 = ref.chat_ids(second)
    want2, _ = ref.greedy(ids2, 12)
    # the first turn's row holds its prompt and its reply but the last token; the second turn starts with them
    held = ids1 + reply1[:-1]
    expected = common_prefix(ids2, held, len(ids2) - 1)
    assert expected == len(held) > len(ids1)  # all of it: the second turn takes the row

    srv = Server("--max-model-len", "384", "--max-batch", "2")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text, usage = turn(c, [SYSTEM, TURN1], False)
        assert text == text1 and usage.prompt_tokens_details.cached_tokens == 0
        text, usage = turn(c, second, False)
        assert text == want2
        assert usage.prompt_tokens == len(ids2) and usage.prompt_tokens_details.cached_tokens == expected
        # the same two prompts again, streamed: each reuses all but its last token (a row holds it and more)
        for messages, ids, want in (([SYSTEM, TURN1], ids1, text1), (second, ids2, want2)):
            text, usage = turn(c, messages, True)
            assert text == want and usage.prompt_tokens_details.cached_tokens == len(ids) - 1
        m = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    prompts = 2 * (len(ids1) + len(ids2))
    reused = expected + len(ids1) - 1 + len(ids2) - 1
    assert metric(m, "moeflow_prefix_cache_enabled") == 1
    assert metric(m, "moeflow_prefix_cache_lookups_total") == 4 and metric(m, "moeflow_prefix_cache_hits_total") == 3
    assert metric(m, "moeflow_prefix_cache_reused_tokens_total") == reused
    assert metric(m, "moeflow_prompt_tokens_total") == prompts
    assert metric(m, "moeflow_prefill_tokens_total") == prompts - reused
    assert metric(m, "moeflow_prefix_cache_rows") >= 1


def test_prefix_cache_off_reuses_nothing():
    srv = Server("--max-model-len", "384", "--max-batch", "2", "--prefix-cache", "off")
    try:
        assert any("prefix cache off" in line for line in srv.output)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text, usage = turn(c, [SYSTEM, TURN1], False)
        _, again = turn(c, [SYSTEM, TURN1, {"role": "assistant", "content": text}, TURN2], False)
        assert again.prompt_tokens_details.cached_tokens == 0
        m = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    assert metric(m, "moeflow_prefix_cache_enabled") == 0 and metric(m, "moeflow_prefix_cache_hits_total") == 0
    assert metric(m, "moeflow_prefill_tokens_total") == metric(m, "moeflow_prompt_tokens_total") > 0
