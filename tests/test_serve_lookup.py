"""`moeflow serve --prompt-lookup 4` through the openai client: a greedy request alone gets greedy generate's text,
plain and streamed, with the same streamed deltas as a server that does not draft (one event per token either way),
and a stop string cuts it where it cuts the undrafted reply; two concurrent requests still get their own greedy text;
/metrics counts drafted and kept tokens, and requests that sample or penalise draft none."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, Reference, Server, metric

PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", "1 2 3 4 5 6 7 8 9 1 2 3 4")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def servers():
    """(the drafting server, a server without drafting), otherwise alike."""
    args = ("--max-model-len", "256", "--max-batch", "2")
    drafting = Server(*args, "--prompt-lookup", "4")
    try:
        plain = Server(*args)
    except BaseException:
        drafting.stop()
        raise
    yield drafting, plain
    drafting.stop()
    plain.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def deltas(srv: Server, prompt: str, **kw) -> list[str]:
    """The text deltas of one streamed completion."""
    chunks = client(srv).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **kw)
    return [ch.choices[0].text for ch in chunks if ch.choices]


def counters(srv: Server) -> tuple[float, float]:
    m = httpx.get(srv.url + "/metrics", timeout=30).text
    return (metric(m, "moeflow_prompt_lookup_draft_tokens_total"),
            metric(m, "moeflow_prompt_lookup_accepted_tokens_total"))


def test_greedy_replies_and_streamed_deltas_equal_the_undrafted_servers(servers, ref):
    drafting, plain = servers
    assert any("prompt lookup 4" in line for line in drafting.output)
    for prompt in PROMPTS:
        want, n = ref.greedy(ref.tokenizer.encode(prompt), MAX_TOKENS)
        before = counters(drafting)
        r = client(drafting).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        drafted, kept = (a - b for a, b in zip(counters(drafting), before, strict=True))
        assert r.choices[0].text == want and r.usage.completion_tokens == n
        assert 0 < kept <= drafted  # drafts were kept: several tokens per pass
        got = deltas(drafting, prompt, temperature=0)
        assert got == deltas(plain, prompt, temperature=0) and "".join(got) == want
        stop = want[len(want) // 2: len(want) // 2 + 3]  # a piece of the reply's second half
        cut = client(drafting).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == want[: want.index(stop)]


def test_concurrent_requests_get_their_greedy_text(servers, ref):
    drafting, _ = servers
    want = [ref.greedy(ref.tokenizer.encode(p), MAX_TOKENS)[0] for p in PROMPTS]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: client(drafting).completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text, PROMPTS))
    assert got == want


@pytest.mark.parametrize("kw", [dict(temperature=0.8, seed=1), dict(temperature=0, frequency_penalty=0.5)],
                         ids=["sampled", "penalised"])
def test_sampled_and_penalised_requests_draft_nothing(servers, kw):
    drafting, plain = servers
    before = counters(drafting)
    got = deltas(drafting, PROMPTS[1], **kw)
    assert counters(drafting) == before
    assert got == deltas(plain, PROMPTS[1], **kw)  # (seeded: the undrafted server's reply)
