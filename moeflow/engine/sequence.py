"""One request inside the serving engine (:class:`Sequence`) and what the engine reports as it runs
(:class:`EngineListener`); :mod:`moeflow.engine.continuous` runs them."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from moeflow.chat.guided import Guide
from moeflow.engine.sampling import SamplingParams


class Sequence:
    """One request inside the engine. ``cancel()`` may be called from any thread.

    Tokens and the end are reported through ``on_event(token_id, finish_reason)``, called on the engine
    thread: ``(id, None)`` per new token, then once ``(None, reason)`` with reason "stop" (an end-of-turn
    token or the stop check), "length", "cancelled" or "error". Without ``on_event`` the events queue up
    for :meth:`events` / :meth:`result`.
    """

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 on_event: Callable[[int | None, str | None], None] | None = None,
                 stop_check: Callable[[list[int]], bool] | None = None) -> None:
        self.id = next(Sequence._ids)
        self.prompt_ids, self.params, self.stop_check = list(prompt_ids), params, stop_check
        self.gen_config = params.generation_config()
        self.sampler_config = replace(self.gen_config, repetition_penalty=1.0)  # _sample applies the penalties
        self.guide: Guide | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self._events: queue.Queue | None = None
        if on_event is None:
            self._events = queue.Queue()
            on_event = lambda token, reason: self._events.put((token, reason))  # noqa: E731
        self.on_event = on_event
        self.generated: list[int] = []
        # per generated token when params.logprobs is set: (its log-probability, [(id, logprob)] top k)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.row: int | None = None
        self.prefilled = 0  # prompt tokens already in the cache
        self.cached_tokens = 0  # of them, those the prefix cache held when it got its row (not prefilled)
        self.draft_tokens = self.accepted_tokens = 0  # prompt lookup (moeflow.engine.continuous_lookup)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def fed_tokens(self) -> list[int]:
        """The tokens whose keys its row holds, in position order: the prompt read so far, then every generated
        token but the last (sampled, not yet fed back)."""
        if self.prefilled < len(self.prompt_ids):
            return self.prompt_ids[: self.prefilled]
        return self.prompt_ids + self.generated[:-1]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def events(self, timeout: float | None = None) -> Iterator[tuple[int | None, str | None]]:
        """(token, None) per token, then (None, finish_reason); only when no ``on_event`` was given."""
        if self._events is None:
            raise RuntimeError("this sequence reports through its on_event callback")
        while True:
            token, reason = self._events.get(timeout=timeout)
            yield token, reason
            if reason is not None:
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the end; the generated token ids (end-of-turn token included when one ended it)."""
        for _ in self.events(timeout):
            pass
        return list(self.generated)


class EngineListener:
    """What the engine reports as it runs (the server's metrics implement it). Every hook runs on the engine
    thread and must return quickly."""

    def on_pass(self, phase: str, batch: int, tokens: int, seconds: float) -> None:
        """One forward pass: phase "prefill"/"decode", sequences in it, real tokens in it."""

    def on_admit(self, seq: Sequence) -> None:
        """A sequence got its KV row (``seq.cached_tokens``: prompt tokens the prefix cache held for it)."""

    def on_queue(self, waiting: int, running: int) -> None:
        """Queue depth and running sequences after an iteration's admissions and departures."""

    def on_finish(self, seq: Sequence) -> None:
        """A sequence left (its timings and counts are final)."""
