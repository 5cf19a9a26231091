"""`moeflow serve` on the embedded model, driven by the official openai client (issue 19).

Exactness: at temperature 0 every reply is the text of single-request greedy `generate` on the same
(templated) prompt, also with 16 clients at once (continuous batching, chunked prefill). The server runs
the default CPU kernels (fp32 activations, torch's int4 expert kernels), the same as the in-process reference.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, Reference, Server, metric

KEY = "test-key"
CONTEXT = 384
POLL_S, POLL_LIMIT_S = 0.05, 30.0


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-model-len", str(CONTEXT), "--max-batch", "16", "--max-queue", "16",
                 "--prefill-chunk", "32", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


def client(srv: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def get_metrics(srv: Server) -> str:
    return httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text


def chat_text(c: openai.OpenAI, messages: list[dict], max_tokens: int, stream: bool) -> tuple[str, object, str]:
    """(text, usage, finish_reason) of one chat completion at temperature 0."""
    if not stream:
        r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content, r.usage, r.choices[0].finish_reason
    parts, usage, finish = [], None, None
    for chunk in c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), usage, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_is_greedy_generate_on_the_templated_prompt(server, ref, stream):
    messages = [{"role": "system", "content": "You answer questions about Python."},
                {"role": "user", "content": "What does the import statement do?"}]
    text, usage, finish = chat_text(client(server), messages, 40, stream)
    ids = ref.chat_ids(messages)
    want, n = ref.greedy(ids, 40)
    assert text == want
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), n, len(ids) + n)
    assert finish == ("length" if n == 40 else "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_is_greedy_generate(server, ref, stream):
    prompt = "The import statement"
    c = client(server)
    if stream:
        chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        usage = chunks[-1].usage
    else:
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        text, usage = r.choices[0].text, r.usage
    ids = ref.tokenizer.encode(prompt)
    want, n = ref.greedy(ids, 24)
    assert text == want
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), n, len(ids) + n)


def test_ignore_eos_goes_on_to_max_tokens(server, ref):
    """An end-of-turn token made certain by logit_bias ends the reply, unless ignore_eos (vLLM's, llama.cpp's)."""
    c = client(server)
    bias = {str(ref.stop_ids[0]): 100}
    ended = c.completions.create(model=MODEL_NAME, prompt="The", max_tokens=6, temperature=0, logit_bias=bias)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    full = c.completions.create(model=MODEL_NAME, prompt="The", max_tokens=6, temperature=0, logit_bias=bias,
                                extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6


def test_stop_string_cuts_the_text(server, ref):
    prompt = "The import statement"
    want, _ = ref.greedy(ref.tokenizer.encode(prompt), 24)
    stop = want.strip()[3:6]  # a piece of the greedy continuation
    r = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want[: want.index(stop)]
    assert r.usage.completion_tokens < 24


def test_sixteen_concurrent_clients_get_their_single_request_output(server, ref):
    rng = random.Random(19)
    words = ("module import class function return value string list dict object the of a is to in "
             "statement attribute exception file path").split()
    jobs = []
    for i in range(16):
        content = " ".join(rng.choice(words) for _ in range(rng.randrange(2, 40)))  # 10 to ~250 bytes
        jobs.append(([{"role": "user", "content": content}], rng.randrange(1, 48), i % 2 == 1))
    before = get_metrics(server)
    c = client(server)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: chat_text(c, *job), jobs))
    after = get_metrics(server)
    for (messages, max_tokens, _), (text, usage, _) in zip(jobs, results, strict=True):
        want, n = ref.greedy(ref.chat_ids(messages), max_tokens)
        assert text == want
        assert usage.completion_tokens == n
    # the engine ran passes over more than one sequence while these clients were served
    def multi(text: str) -> float:
        total = metric(text, "moeflow_batch_size_count", phase="decode")
        return total - metric(text, "moeflow_batch_size_bucket", phase="decode", le="1.0")
    assert multi(after) - multi(before) > 0
    # a CPU server decodes eagerly (--cuda-graphs auto: on CUDA only)
    assert metric(after, "moeflow_decode_graphs", state="off") == 1
    assert metric(after, "moeflow_decode_graphs", state="on") == 0
    assert metric(after, "moeflow_decode_graph_captures_total") == 0


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body, headers=auth) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(url + path, content=content, headers={**headers, "content-type": "application/json"},
                          timeout=30)

    def check(r: httpx.Response, status: int, param=None, code=None) -> None:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param
        if code is not None:
            assert err["code"] == code

    msg = [{"role": "user", "content": "hi"}]
    check(post("/v1/chat/completions", {"model": MODEL_NAME, "messages": msg, "max_tokens": -3}), 400, "max_tokens")
    check(post("/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404, "model", "model_not_found")
    check(post("/v1/completions", {"model": MODEL_NAME, "prompt": "x" * (CONTEXT + 10), "max_tokens": 4}), 400,
          code="context_length_exceeded")
    check(post("/v1/completions", {"model": MODEL_NAME, "prompt": "x" * 300, "max_tokens": 100}), 400,
          code="context_length_exceeded")
    check(post("/v1/chat/completions", '{"model": "' + MODEL_NAME + '", "messages": [}'), 400)
    check(post("/v1/chat/completions", {"model": MODEL_NAME, "messages": msg, "n": 17}), 400, "n")
    check(post("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "narrator", "content": "x"}]}),
          400)
    check(post("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 999]}), 400)
    check(post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi"}, headers={"Authorization": "Bearer no"}),
          401, code="invalid_api_key")
    check(httpx.get(url + "/v1/models", timeout=30), 401)
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # no key needed
    # the openai client maps them to its exceptions
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="hi", max_tokens=2)
    # and the server still serves
    assert [m.id for m in client(server).models.list().data] == [MODEL_NAME]
    r = client(server).completions.create(model=MODEL_NAME, prompt="The", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_full_queue_is_503_and_a_disconnect_frees_the_row():
    """One KV row and a queue of one: A runs, B waits, C is refused; A hangs up, so B gets the row."""
    srv = Server("--max-model-len", "512", "--max-batch", "1", "--max-queue", "1")
    try:
        c = client(srv, key="unused")
        msg = [{"role": "user", "content": "Tell me about modules."}]
        a = c.chat.completions.create(model=MODEL_NAME, messages=msg, max_tokens=400, temperature=0, stream=True)
        a_iter = iter(a)
        next(a_iter), next(a_iter)  # the role chunk, then a generated token: A holds the row
        b = c.chat.completions.create(model=MODEL_NAME, messages=msg, max_tokens=5, temperature=0, stream=True)
        b_iter = iter(b)
        next(b_iter)  # the role chunk comes at once; B's tokens wait for a row
        with pytest.raises(openai.APIStatusError) as refused:
            c.chat.completions.create(model=MODEL_NAME, messages=msg, max_tokens=5)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "overloaded"
        a.close()  # the client goes away mid-stream
        rest = list(b_iter)  # B runs to its end only if A's row was freed
        assert rest[-1].choices[0].finish_reason == "length"
        deadline = time.monotonic() + POLL_LIMIT_S
        while True:
            m = get_metrics(srv)
            if metric(m, "moeflow_sequences_finished_total", reason="cancelled") >= 1 or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        assert metric(m, "moeflow_sequences_finished_total", reason="cancelled") == 1
        assert metric(m, "moeflow_running_sequences") == 0
        assert metric(m, "moeflow_generation_tokens_total") < 400 + 5  # A stopped early
        # a plain (non-streamed) request whose client gives up is cancelled too: its client waits 0.1 s and the
        # server looks every 0.1 s (DISCONNECT_POLL_S), while 450 tokens take the tiny model >= 0.6 s on this CPU
        # (a 1 s wait with a 0.5 s poll let fast runs finish first: the test failed as "DID NOT RAISE")
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/chat/completions", timeout=0.1,
                       json={"model": MODEL_NAME, "messages": msg, "max_tokens": 450, "temperature": 0})
        deadline = time.monotonic() + POLL_LIMIT_S
        while metric(m, "moeflow_sequences_finished_total", reason="cancelled") < 2 and time.monotonic() < deadline:
            time.sleep(POLL_S)
            m = get_metrics(srv)
        assert metric(m, "moeflow_sequences_finished_total", reason="cancelled") == 2
        assert metric(m, "moeflow_running_sequences") == 0
    finally:
        srv.stop()


def test_logprobs_are_the_models_distribution(server, ref):
    import torch

    messages = [{"role": "user", "content": "What is a package?"}]
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3)
    ids = ref.chat_ids(messages)
    full = ref.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=[])
    logp = torch.log_softmax(ref.model(full).logits[0].double(), dim=-1)  # one pass over prompt + reply
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for j, entry in enumerate(content):
        token = int(full[0, len(ids) + j])
        assert entry.token == ref.tokenizer.decode([token])
        assert abs(entry.logprob - float(logp[len(ids) + j - 1, token])) < 1e-3
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top
    # completions, streamed: the tokens of the chunks' logprobs spell the text
    chunks = list(client(server).completions.create(model=MODEL_NAME, prompt="The import", max_tokens=8,
                                                    temperature=0, logprobs=2, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == text and len(tokens) == 8


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_seeded_samples_of_generate(server, ref, stream):
    """``n`` choices: choice i is the single-request sample with seed ``seed + i``, streamed or not; the prompt
    is counted once in the usage, the replies' tokens summed."""
    c = client(server)
    messages = [{"role": "user", "content": "Tell me about modules."}]
    ids = ref.chat_ids(messages)
    want = []
    for i in range(3):
        out = ref.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=True, temperature=0.9, top_k=0,
                                 top_p=1.0, seed=7 + i, eos_token_id=ref.stop_ids)[0, len(ids):].tolist()
        want.append((ref.tokenizer.decode([t for t in out if t not in ref.stop_ids]), len(out)))
    assert len({text for text, _ in want}) == 3  # three different samples: the seeds really differ
    kwargs = dict(model=MODEL_NAME, messages=messages, n=3, max_tokens=12, temperature=0.9, top_p=1.0, seed=7,
                  extra_body={"top_k": 0})
    if not stream:
        r = c.chat.completions.create(**kwargs)
        assert [(ch.index, ch.message.content) for ch in r.choices] == [(i, t) for i, (t, _) in enumerate(want)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), sum(n for _, n in want))
        return
    texts = ["", "", ""]
    finishes = [None, None, None]
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [t for t, _ in want] and None not in finishes


def test_the_printed_address_accepts_connections_before_uvicorn_starts():
    """The server prints its address once the socket listens, so a client that connects at once is queued, not
    refused (CI saw 'connection refused' when uvicorn's start was slow on a loaded machine)."""
    import socket

    from moeflow.cli.serve import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    try:
        client = socket.create_connection(sock.getsockname(), timeout=5)  # nothing has called accept()
        client.close()
    finally:
        sock.close()
