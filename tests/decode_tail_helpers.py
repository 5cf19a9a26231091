"""What the one-call CPU decode steps' tail tests share (test_cpu_decode_head.py, test_gpt_oss_decode_head.py): a
recorder of every step call that ran a tail, and the check that the tail gives the per-call head's logits bit for
bit at 1, 2 and 3 threads with the tokens of the layers run one by one."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch


def record_tails(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list:
    """Wrap ``module.name`` (the step function its native layers call) so that every call with a ``head`` appends
    (the last layer's output [1, 1, H], the logits [1, 1, V]) as copies to the returned list; the native
    multi-token loop is switched off (``MOEFLOW_NATIVE_LOOP=0``)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = getattr(module, name)
    # every decode step through the per-token step (not engine/native_decode.py's chunks, which
    # tests/test_native_decode_loop.py checks against it)
    monkeypatch.setenv("MOEFLOW_NATIVE_LOOP", "0")

    def step(*a, **kw):
        out = inner(*a, **kw)
        if kw.get("head") is not None:
            seen.append((out.clone(), kw["logits"].clone()))
        return out
    monkeypatch.setattr(module, name, step)
    return seen


def check_tail(model, generate: Callable[[int], torch.Tensor], n: int, tails: list) -> None:
    """n greedy tokens (``generate(n)``) at 1, 2 and 3 threads: each decode step's logits from the tail, the
    per-call head's logits of the same last-layer output bit for bit and the same at every thread count; the tokens
    of the layers run one by one (the one call off)."""
    dec = model.model
    dec.layers_step.enabled = False
    ref = generate(n)
    dec.layers_step.enabled = True
    assert not tails
    threads = torch.get_num_threads()
    per_count = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            tails.clear()
            out = generate(n)
            assert torch.equal(out, ref), f"{t} threads"
            assert len(tails) == n - 1  # every decode step (the prefill runs the layers one by one)
            with torch.inference_mode():
                for x, logits in tails:
                    assert torch.equal(logits, dec.lm_head(dec.norm(x)).float()), f"{t} threads"
            per_count.append([lg for _, lg in tails])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for other in per_count[1:] for a, b in zip(per_count[0], other, strict=True))
