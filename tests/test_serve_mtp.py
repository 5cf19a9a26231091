"""`moeflow serve --speculative mtp --num-speculative-tokens 2` through the openai client, on a tiny DeepSeek-V3 with
one MTP layer and the embedded model's tokenizer: a greedy request alone gets greedy generate's text, plain and
streamed, with the same streamed deltas as a server that does not draft; /metrics counts MTP drafts (not prompt
lookup's); a sampled request drafts nothing. ~30 s on 2 cores (two servers)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from mtp_helpers import make_mtp_checkpoint_with_tokenizer
from serve_helpers import Server, metric
from test_mtp import SHAPE

from moeflow import MoEModel

PROMPTS = ("The import statement", "def add(a, b):")
MAX_TOKENS = 16
KV_GB = "0.0000931"  # 99,965 bytes


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_mtp_checkpoint_with_tokenizer(tmp_path_factory.mktemp("serve_mtp"), **dict(SHAPE))


@pytest.fixture(scope="module")
def servers(path):
    """(the drafting server, a server without drafting), otherwise alike."""
    args = ("--model", str(path), "--served-model-name", "tiny", "--max-model-len", "128", "--max-batch", "2")
    drafting = Server(*args, "--speculative", "mtp", "--num-speculative-tokens", "2", "--kv-cache-gb", KV_GB)
    try:
        plain = Server(*args)
    except BaseException:
        drafting.stop()
        raise
    yield drafting, plain
    drafting.stop()
    plain.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def deltas(srv: Server, prompt: str, **kw) -> list[str]:
    chunks = client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **kw)
    return [ch.choices[0].text for ch in chunks if ch.choices]


def counters(srv: Server) -> tuple[float, ...]:
    m = httpx.get(srv.url + "/metrics", timeout=30).text
    return tuple(metric(m, f"moeflow_{kind}_{what}_tokens_total") for kind in ("mtp", "prompt_lookup")
                 for what in ("draft", "accepted"))


def test_greedy_replies_and_deltas_equal_the_undrafted_servers_and_generates(servers, path):
    drafting, plain = servers
    # the budget holds two rows of 128 positions (36 KiB each), but one with the drafter's buffers (44 KiB a row)
    assert any("MTP speculation 2 tokens" in line and "KV cache 1 rows" in line for line in drafting.output)
    model = MoEModel.from_pretrained(path)
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):]
        before = counters(drafting)
        r = client(drafting).completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        mtp_drafted, mtp_kept, lookup_drafted, _ = (a - b for a, b in zip(counters(drafting), before, strict=True))
        assert r.usage.completion_tokens == len(out) == MAX_TOKENS
        assert r.choices[0].text == model.tokenizer.decode(out.tolist())
        assert mtp_drafted > 0 and 0 <= mtp_kept <= mtp_drafted and lookup_drafted == 0
        got = deltas(drafting, prompt, temperature=0)
        assert got == deltas(plain, prompt, temperature=0) and "".join(got) == r.choices[0].text
    before = counters(drafting)
    kw = dict(temperature=0.8, seed=1)
    assert deltas(drafting, PROMPTS[0], **kw) == deltas(plain, PROMPTS[0], **kw)
    assert counters(drafting) == before
