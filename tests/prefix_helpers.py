"""A scripted multi-request scenario for the serving engine's prefix cache, run through an engine (with the cache on
or off) or through single-request greedy ``generate``, and the prompt tokens the cache should reuse in it.

Waves of requests, each wave after the previous one ended (later prompts extend earlier replies); rows=3:

1. A = SYS + Q1                               (nothing cached)
2. A2 = A + reply(A) + Q2                     turn 2: A's whole row is taken (A + reply[:-1] reused)
3. B = SYS + Q3                               shares the system prompt: copied from A2's row into an empty row
4. C = A[:-5]                                 a strict prefix of a cached prompt: all but its last token reused
5. G = A2 + reply(A2) + Q5, D = SYS + Q4, F = X (unrelated), and E = D + Q6 submitted when D has produced 2 tokens:
   G takes A2's row (turn 3), D copies the system prompt into the least recent idle row (evicting B), F evicts the
   least recent idle row (C), E waits for a row (all three run) and then copies D's prompt from D's row.
Hybrid models reuse whole rows only: A2 and G; the others nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.prefix_cache import common_prefix

TIMEOUT_S = 120
SYS = b"### system\nYou answer questions about Python modules.\n### user\n"
Q1, Q2 = b"What does the import statement do?\n", b"And from-imports?\n"
Q3, Q4, Q5 = b"How are packages found?\n", b"Name a builtin module.\n", b"Thanks. Anything else?\n"
Q6, X = b" Please be brief.\n", b"Completely unrelated text about rivers and lakes.\n"
# a wave: (name, prompt, max_new_tokens, after) with after = (name, k): submit when that request has k tokens
Wave = list[tuple[str, list[int], int, tuple[str, int] | None]]
Runner = Callable[[Wave], dict[str, tuple[list[int], int]]]  # name -> (generated tokens, cached prompt tokens)


def scenario(run: Runner, vocab: int) -> dict[str, tuple[list[int], list[int], int]]:
    """The waves above through ``run``: name -> (prompt, generated, cached tokens). Bytes are token ids modulo
    ``vocab`` (the embedded model's tokenizer is byte-level)."""
    tok = lambda text: [b % vocab for b in text]  # noqa: E731
    out: dict[str, tuple[list[int], list[int], int]] = {}

    def wave(*requests) -> None:
        got = run(list(requests))
        out.update({name: (prompt, *got[name]) for name, prompt, _, _ in requests})

    a = tok(SYS + Q1)
    wave(("A", a, 10, None))
    a2 = a + out["A"][1] + tok(Q2)
    wave(("A2", a2, 10, None))
    wave(("B", tok(SYS + Q3), 8, None))
    wave(("C", a[:-5], 6, None))
    d = tok(SYS + Q4)
    wave(("G", a2 + out["A2"][1] + tok(Q5), 6, None), ("D", d, 12, None), ("F", tok(X), 12, None),
         ("E", d + tok(Q6), 6, ("D", 2)))
    return out


def check_cached(out: dict[str, tuple[list[int], list[int], int]], vocab: int, whole_rows_only: bool) -> None:
    """The prompt tokens each request reused are the rule's (module docstring)."""
    cached = {name: c for name, (_, _, c) in out.items()}
    turn = lambda name: len(out[name][0]) + len(out[name][1]) - 1  # noqa: E731  (prompt + reply but its last)
    sys_len = len(SYS)
    assert cached["A"] == cached["F"] == 0
    assert cached["A2"] == turn("A") and cached["G"] == turn("A2")
    if whole_rows_only:
        assert cached["B"] == cached["C"] == cached["D"] == cached["E"] == 0, cached
        return
    assert (cached["B"], cached["C"], cached["D"]) == (sys_len, len(out["C"][0]) - 1, sys_len), cached
    assert cached["E"] >= len(out["D"][0]) and cached["E"] <= len(out["E"][0]) - 1, cached
    assert common_prefix(out["E"][0], out["D"][0] + out["D"][1], len(out["E"][0])) >= cached["E"]


def generate_runner(model) -> Runner:
    """Each request alone through greedy generate (no end-of-turn token)."""
    def run(wave: Wave) -> dict[str, tuple[list[int], int]]:
        return {name: (model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[])
                       [0, len(p):].tolist(), 0) for name, p, n, _ in wave}
    return run


def engine_runner(engine: ContinuousEngine) -> Runner:
    """A wave through a started engine: requests without ``after`` at once, the others from the engine thread when
    the request they follow has produced its k-th token."""
    def run(wave: Wave) -> dict[str, tuple[list[int], int]]:
        seqs, done = {}, threading.Semaphore(0)
        counts = dict.fromkeys([name for name, *_ in wave], 0)

        def submit(name: str, prompt: list[int], n: int) -> None:
            def on_event(token, reason) -> None:
                if token is not None:
                    counts[name] += 1
                    for other, p, m, after in wave:
                        if after == (name, counts[name]):
                            submit(other, p, m)
                if reason is not None:
                    done.release(len(wave) if reason == "error" else 1)  # an error: stop waiting at once
            seqs[name] = engine.submit(prompt, SamplingParams(max_new_tokens=n), on_event=on_event)

        for name, p, n, after in wave:
            if after is None:
                submit(name, p, n)
        for _ in wave:
            assert done.acquire(timeout=TIMEOUT_S), "the engine did not finish the wave in time"
        assert [s.finish_reason for s in seqs.values()] == ["length"] * len(wave), [s.error for s in seqs.values()]
        return {name: (s.generated, s.cached_tokens) for name, s in seqs.items()}
    return run


def run_engine(model, cache, prefix_cache: bool = True, chunk: int = 16
               ) -> tuple[dict[str, tuple[list[int], list[int], int]], int]:
    """The scenario through a fresh engine over ``cache``: (its requests, prompt tokens its prefill passes read)."""
    engine = ContinuousEngine(model, cache, prefill_chunk=chunk, prefix_cache=prefix_cache).start()
    model.stats.reset()
    try:
        out = scenario(engine_runner(engine), model.config.vocab_size)
    finally:
        engine.stop()
    assert cache.free_rows == cache.rows
    return out, model.stats.prefill.tokens


def tokens(out: dict[str, tuple[list[int], list[int], int]]) -> dict[str, list[int]]:
    return {name: gen for name, (_, gen, _) in out.items()}


def check_engine(model, cache, want: dict[str, list[int]], whole_rows_only: bool) -> None:
    """The scenario with the prefix cache: each request's tokens are generate's, the cache reused what the rule
    says, and the prefill passes read only the prompt tokens it did not reuse."""
    out, prefilled = run_engine(model, cache)
    assert tokens(out) == want
    check_cached(out, model.config.vocab_size, whole_rows_only)
    prompts = sum(len(p) for p, _, _ in out.values())
    assert prefilled == prompts - sum(c for _, _, c in out.values()) < prompts
