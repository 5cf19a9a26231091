"""Continuous batching: one scheduler thread owns the model and steps every running sequence together.

Requests queue (:meth:`ContinuousEngine.submit`). Each iteration of the scheduler thread

1. drops cancelled sequences (a client that went away) and frees their KV rows,
2. admits waiting requests while a KV row is free (:class:`~moeflow.engine.kv_slots.SlotKVCache`),
3. runs one prefill pass over the sequences still reading their prompt, at most ``prefill_chunk`` prompt
   tokens in all, so a long prompt is read over several iterations instead of stalling everyone's decode,
4. runs one decode pass over every sequence that has a token to feed: one token each, at its own position.

A sequence whose prefill finishes samples its first token and joins the next decode pass; a finished one
(end-of-turn token, ``max_new_tokens``, a stop check, cancellation) leaves and its row goes to the queue.
The offload backend sees one batch per pass, as in ``generate``.

Prefix cache (``prefix_cache``, on by default): a finished sequence's row keeps its keys, and a new prompt that
starts with tokens a row holds gets them (the row itself, or a copy of the shared prefix) and prefills only the
rest (:mod:`moeflow.engine.prefix_cache`).

Captured decode passes (``cuda_graphs``, on when the model decodes through CUDA graphs): a decode pass of B
sequences is padded to Bp, the next power of two, with copies of its first sequence (same row, position and
token: identical writes, the same experts, so an offload backend loads nothing more for them; their logits are
dropped) and reads a key-length bucket (:func:`key_bucket`), so it runs on the slotted cache's persistent
:class:`~moeflow.engine.kv_slots.SlotDecodeView` of (Bp, bucket), whose step is captured once and replayed
(:class:`~moeflow.engine.cuda_graphs.CudaGraphDecode`). Prefill passes stay eager. Counts (stats, the listener)
are of real tokens only. :meth:`ContinuousEngine.warm_up` captures the steps of every padded batch size at the
smallest bucket before the first request (``moeflow serve`` calls it before it reports ready).

Prompt lookup (``prompt_lookup``, off by default): while one greedy sequence decodes alone, its decode pass also
verifies tokens drafted from its own context, several tokens per pass (:mod:`moeflow.engine.continuous_lookup`:
captured too, one more step per key bucket). MTP speculation (``num_speculative_tokens``, off by default): the
same, drafted by the model's multi-token-prediction layers (:mod:`moeflow.engine.continuous_mtp`: eager passes).

Token scheduler (``micro_batch_size``, off by default; "auto": where the policy predicts routing paths, expertflow):
a decode step's rows run as micro-batches grouped by their predicted routing paths, each a pass of its own
(:mod:`moeflow.engine.continuous_regroup`).

Token history: a backend whose predictor reads every token so far (``ExpertBackend.needs_history``: the
expertflow policy) gets them from a :class:`~moeflow.engine.token_history.TokenHistory` on the device, which each
pass writes its own tokens into; other backends get none (no per-pass host work over the whole context).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

from moeflow.chat.guided import Guide
from moeflow.engine.continuous_lookup import LookupDrafter
from moeflow.engine.continuous_mtp import MTPEngineDrafter
from moeflow.engine.continuous_regroup import make_regrouper, run_split
from moeflow.engine.continuous_sampling import sample_token
from moeflow.engine.cuda_graphs import CudaGraphDecode
from moeflow.engine.kv_slots import SlotKVCache, check_slotted
from moeflow.engine.lookup import DEFAULT_MAX_NGRAM
from moeflow.engine.prefix_cache import MIN_PREFIX_TOKENS, PrefixCache
from moeflow.engine.sampling import SamplingParams
from moeflow.engine.sequence import EngineListener, Sequence
from moeflow.engine.served import ServedModel
from moeflow.engine.slot_verify import key_bucket
from moeflow.engine.token_history import TokenHistory
from moeflow.errors import InputError, MoeflowError
from moeflow.kernels.cpu.step import NATIVE_ATTENTION_TOKENS

log = logging.getLogger(__name__)


# a CPU decode pass of up to this many sequences runs them one after another, each on its row through the one-call
# step (each row generate's numbers): faster than the layers one by one over the batch at 2 (aggregate tok/s on the
# peer model, 2-core Zen 4: 143 vs 127 at 1 thread, 181 vs 109 at 2); at 3 the batched layers win at 1 thread
ROW_LOOP_MAX = 2


def padded_batch(batch: int) -> int:
    """A captured decode pass's batch size: the next power of two >= ``batch`` (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


class EngineOverloaded(MoeflowError):
    """The request queue is full (or the engine is stopping): try again later (HTTP 503)."""


class ContinuousEngine:
    """Continuous batching over a loaded model (``MoEOffloadedMixtral``) and a :class:`SlotKVCache`.

    prefill_chunk: prompt tokens read per iteration, over all prefilling sequences together.
    max_queue: waiting requests beyond the running ones; one more raises :class:`EngineOverloaded`.
    cuda_graphs: capture the decode passes (see the module docstring); None: when the model decodes through
    CUDA graphs (``from_pretrained``'s ``cuda_graphs``, on by default on CUDA); True needs such a model.
    ``graphs`` is that model's :class:`CudaGraphDecode` when on, else None. ``history``: the device token history
    when the model's backend (the one at construction) ``needs_history``, else None.
    ``prefix_cache``: a finished sequence's row keeps its keys for the next prompt that starts the same way
    (:class:`~moeflow.engine.prefix_cache.PrefixCache`, ``self.prefix``; None when off), from
    ``prefix_min_tokens`` shared tokens.
    ``prompt_lookup``: draft up to that many tokens per decode pass by prompt lookup (``max_matching_ngram_size``
    as in ``generate``) while one greedy sequence decodes alone (:class:`~moeflow.engine.continuous_lookup.
    LookupDrafter`, ``self.lookup``; None when off, the default).
    ``num_speculative_tokens``: draft up to that many tokens per decode pass with the model's MTP layers
    (``from_pretrained(mtp=True)``) while one greedy sequence decodes alone (:class:`~moeflow.engine.
    continuous_mtp.MTPEngineDrafter`, ``self.mtp``; None when off, the default). Every pass then runs eagerly
    (``cuda_graphs`` None means off with it; True is refused) and keeps its hidden states for the MTP layers.
    ``micro_batch_size``: decode steps in micro-batches grouped by predicted routing paths, ExpertFlow's token
    scheduler (:mod:`moeflow.engine.continuous_regroup`, ``self.regroup``; None, the default: off): "auto" turns
    it on, two micro-batches, where the policy predicts routing paths (expertflow); ``token_scheduler`` picks how
    they are grouped (``continuous_regroup.SCHEDULERS``; "policy": the policy's ``keep_contiguous``).
    """

    def __init__(self, model: ServedModel, cache: SlotKVCache, max_queue: int = 64, prefill_chunk: int = 64,
                 listener: EngineListener | None = None, cuda_graphs: bool | None = None,
                 prefix_cache: bool = True, prefix_min_tokens: int = MIN_PREFIX_TOKENS,
                 prompt_lookup: int | None = None, max_matching_ngram_size: int = DEFAULT_MAX_NGRAM,
                 num_speculative_tokens: int | None = None, micro_batch_size: int | str | None = None,
                 token_scheduler: str = "policy") -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if num_speculative_tokens is not None:
            if prompt_lookup:
                raise ValueError("num_speculative_tokens and prompt_lookup are two ways to draft: pass one")
            if cuda_graphs is None:  # (auto: MTP drafting runs the passes eagerly)
                cuda_graphs = False
        decode = model.runner.decode_fn
        if cuda_graphs and not isinstance(decode, CudaGraphDecode):
            raise ValueError("cuda_graphs=True needs a model that decodes through CUDA graphs "
                             "(from_pretrained(cuda_graphs=True) or capture_decode())")
        self.graphs = decode if cuda_graphs is not False and isinstance(decode, CudaGraphDecode) else None
        check_slotted(model, cache)
        self.model, self.cache = model, cache
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.listener = listener or EngineListener()
        self.device = model.device
        backend = model.runner.backend
        self.regroup = make_regrouper(backend, micro_batch_size, token_scheduler)
        needs = backend is not None and backend.needs_history or self.regroup is not None
        self.history = TokenHistory(cache.rows, cache.max_len, self.device) if needs else None
        self.prefix = PrefixCache(cache, prefix_min_tokens) if prefix_cache else None
        # one sequence's passes on its row (cache.row) where the decoder has the one-call step; decode passes of up to
        # row_loop sequences as one such pass per row (not where a pass reads history or keeps MTP hidden states)
        self.row_passes = model.runner.decoder.layers_step is not None and cache.row(0) is not None
        self.row_loop = ROW_LOOP_MAX if self.row_passes and self.history is None and num_speculative_tokens is None \
            else 0
        self.lookup = LookupDrafter(self, prompt_lookup, max_matching_ngram_size) if prompt_lookup else None
        self.mtp = MTPEngineDrafter(self, num_speculative_tokens) if num_speculative_tokens is not None else None
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_event: Callable[[int | None, str | None], None] | None = None,
               stop_check: Callable[[list[int]], bool] | None = None, guide: Guide | None = None) -> Sequence:
        """Queue a request (``guide``: its reply held to a grammar). InputError when it can never run,
        EngineOverloaded when the queue is full."""
        self.check_request(len(prompt_ids), params.max_new_tokens)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab})")
        seq = Sequence(prompt_ids, params, on_event, stop_check)
        seq.guide = guide
        with self._cond:
            if self._stopping:
                raise EngineOverloaded("the engine is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise EngineOverloaded(f"{len(self._waiting)} requests are already waiting (max_queue="
                                       f"{self.max_queue}); retry later")
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """InputError unless a prompt of this length plus max_new_tokens fits one KV row."""
        if prompt_tokens < 1:
            raise InputError("the prompt is empty: it needs at least one token")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if prompt_tokens + max_new_tokens > self.cache.max_len:
            raise InputError(f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_new_tokens}) exceeds "
                             f"the context of {self.cache.max_len} tokens")

    def start(self) -> ContinuousEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moeflow-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish nothing more: waiting and running sequences end as "cancelled"; the thread exits."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for seq in list(self._waiting) + self._running:
            self._finish(seq, "cancelled")
        self._waiting.clear()

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stopping and not self._waiting and not self._running:
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._admit()
                try:
                    self._iterate()
                except Exception as e:  # a failed pass ends the sequences in it, never the server
                    log.exception("engine pass failed")
                    for seq in list(self._running):
                        seq.error = f"{type(e).__name__}: {e}"
                        self._finish(seq, "error")  # (their rows' keys may be half written: not kept)
                self.listener.on_queue(len(self._waiting), len(self._running))

    def _admit(self) -> None:
        """Drop cancelled waiting requests; move waiting ones into free rows (caller holds the lock)."""
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            self._finish(seq, "cancelled")
        while self._waiting and self.cache.free_rows:
            seq = self._waiting.popleft()
            if seq.params.max_new_tokens == 0:
                self._finish(seq, "length")
                continue
            seq.row = self._allocate(seq)
            self._running.append(seq)
            self.listener.on_admit(seq)

    def _allocate(self, seq: Sequence) -> int:
        """A free cache row for ``seq`` (there is one): valid positions and token history only where the prefix
        cache gave it its prompt's first ``seq.cached_tokens`` tokens, which it then does not prefill."""
        if self.prefix is None:
            row, reused = self.cache.allocate(), 0
        else:
            place = self.prefix.place(seq.prompt_ids, ((s.row, s.fed_tokens()) for s in self._running))
            row, reused = self.cache.allocate(place.row, keep=place.reused if place.source is None else 0), place.reused
            if place.source is not None:
                self.cache.copy_prefix(place.source, row, reused)
        seq.prefilled = seq.cached_tokens = reused
        if self.history is not None:
            self.history.clear(row, seq.prompt_ids[:reused])
        return row

    def warm_up(self) -> tuple[int, float]:
        """Capture the decode steps of every padded batch size (1, 2, 4, ... up to the cache's rows, at most
        ``graphs.max_steps``) at the smallest key bucket, and prompt lookup's verify step when drafting, before the
        engine starts, so a user's first requests capture nothing there. Each is a pass of token 0 at position 0 of
        a free row, padded with copies (fillers); the row is left free with no valid position. Returns (steps
        captured, seconds); (0, 0.0) when graphs are off."""
        if self.graphs is None or self.graphs.refused is not None:
            return 0, 0.0
        if self._thread is not None:
            raise RuntimeError("warm_up() runs before start(): it uses the engine's model and cache")
        sizes = [1 << i for i in range(padded_batch(self.cache.rows).bit_length())][: self.graphs.max_steps]
        seq = Sequence([0], SamplingParams(max_new_tokens=1))
        seq.row = self.cache.allocate()  # (every row is free before start)
        if self.prefix is not None:
            self.prefix.forget(seq.row)
        if self.history is not None:
            self.history.clear(seq.row)
        before, start = self.graphs.captures, time.perf_counter()
        try:
            with torch.inference_mode():
                for b in sizes:
                    if self.graphs.refused is not None:  # refused: every pass runs eagerly, nothing to warm up
                        break
                    zeros = torch.zeros((b, 1), dtype=torch.long)
                    self._captured_pass([seq] * b, zeros, zeros, count=False)
                if self.lookup is not None and self.graphs.refused is None:  # and the drafted passes' verify step
                    self.lookup.warm_up(seq)
        finally:
            self.cache.valid[seq.row] = False
            self.cache.release(seq.row)  # (not kept by the prefix cache: it holds no valid key)
        return self.graphs.captures - before, time.perf_counter() - start

    def _iterate(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._finish(seq, "cancelled")
        prefilling = [s for s in self._running if s.prefilled < len(s.prompt_ids)]
        if prefilling:
            self._prefill(prefilling)
        decoding = [s for s in self._running if s.prefilled == len(s.prompt_ids) and not s.done]
        drafter = self.lookup if self.lookup is not None else self.mtp
        if decoding and not (drafter is not None and not prefilling and len(decoding) == 1
                             and drafter.step(decoding[0])):  # (a drafted pass, else the plain one)
            self._decode(decoding)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Read the next chunk of each prompt (FIFO, ``prefill_chunk`` tokens in all), right-padded [P, C]."""
        chunks: list[tuple[Sequence, int, int]] = []
        budget = self.prefill_chunk
        for seq in seqs:
            take = min(len(seq.prompt_ids) - seq.prefilled, budget)
            if take <= 0:
                break
            chunks.append((seq, seq.prefilled, take))
            budget -= take
        chunks.sort(key=lambda c: c[0].row)  # rows in order: the cache reads a view, not a gather
        width = max(take for _, _, take in chunks)
        ids = torch.zeros((len(chunks), width), dtype=torch.long)
        pos = torch.zeros((len(chunks), width), dtype=torch.long)
        mask = torch.zeros((len(chunks), width), dtype=torch.bool)
        for i, (seq, start, take) in enumerate(chunks):
            ids[i, :take] = torch.tensor(seq.prompt_ids[start:start + take])
            pos[i, :take] = torch.arange(start, start + take)
            mask[i, :take] = True
        logits = self._pass("prefill", [s for s, _, _ in chunks], ids, pos, mask)
        for i, (seq, start, take) in enumerate(chunks):
            seq.prefilled = start + take
            if seq.prefilled == len(seq.prompt_ids):
                self._emit(seq, sample_token(seq, logits[i, take - 1]), logits[i, take - 1])

    def _decode(self, seqs: list[Sequence]) -> None:
        """Feed each sequence's last token at its own position: [B, 1]."""
        seqs = sorted(seqs, key=lambda s: s.row)
        ids = torch.tensor([[s.generated[-1]] for s in seqs], dtype=torch.long)
        pos = torch.tensor([[len(s.prompt_ids) + len(s.generated) - 1] for s in seqs], dtype=torch.long)
        logits = run_split(self, self.regroup, seqs, ids, pos) if self.regroup is not None else None
        if logits is None:  # (one pass over every row)
            logits = self.decode_pass(seqs, ids, pos)
        greedy = logits[:, -1].argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            plain = not seq.gen_config.do_sample and not seq.params.adjusts_logits and seq.guide is None
            token = greedy[i] if plain else sample_token(seq, logits[i, -1])
            self._emit(seq, token, logits[i, -1])

    def decode_pass(self, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
                    path_scores: torch.Tensor | None = None) -> torch.Tensor:
        """One decode pass over ``seqs``' rows (captured when the engine captures): ids/pos int64 [B, 1] ->
        logits fp32 [B, 1, V]; ``path_scores`` fp32 [B, L, E]: the rows' routing-path scores predicted ahead."""
        if self.graphs is not None and self.graphs.refused is None:
            return self._captured_pass(seqs, ids, pos, path_scores=path_scores)
        return self._pass("decode", seqs, ids, pos, torch.ones_like(ids, dtype=torch.bool), path_scores)

    def _pass(self, phase: str, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
              mask: torch.Tensor, path_scores: torch.Tensor | None = None, count: bool = True) -> torch.Tensor:
        """One forward pass over ``seqs``' rows: ids/pos int64 [B, T], mask bool [B, T] -> logits fp32 [B, T, V];
        path_scores fp32 [B, L, E] or None (:meth:`decode_pass`); ``count``: into the stats and the listener."""
        if phase == "decode" and 1 < len(seqs) <= self.row_loop and ids.shape[1] == 1 and bool(mask.all()):
            start = time.perf_counter()  # (ROW_LOOP_MAX: each row through the one-call step; counted as one pass)
            logits = torch.cat([self._pass(phase, [s], ids[i:i + 1], pos[i:i + 1], mask[i:i + 1],
                                           None if path_scores is None else path_scores[i:i + 1], count=False)
                                for i, s in enumerate(seqs)])
            self._count(phase, len(seqs), len(seqs), time.perf_counter() - start)
            return logits
        dev, host_pos, host_mask = self.device, pos, mask
        all_real = bool(mask.all())  # on the host still: a decode pass's backend reads no mask back
        history = self.history.feed([s.row for s in seqs], ids, pos, mask) if self.history is not None else None
        ids, pos, mask = ids.to(dev), pos.to(dev), mask.to(dev)
        rows = torch.tensor([s.row for s in seqs], dtype=torch.long, device=dev)
        # one sequence of real tokens on the CPU, as many as the native attention takes: its row as a batch-1 static
        # cache (generate's native attention and one-call decode step, in place); else the rows' batch view
        row = self.cache.row(seqs[0].row) if self.row_passes and len(seqs) == 1 and all_real \
            and ids.shape[1] <= NATIVE_ATTENTION_TOKENS else None
        view = row if row is not None else self.cache.batch(rows, pos, mask)
        positions, cache_position = (pos, pos[0]) if row is not None else (view.cache_position, view.cache_position)
        self.model.stats.set_phase(phase)
        start = time.perf_counter()
        out = self.model.runner.forward_pass(ids, positions, view, cache_position, mask, phase,
                                             rows=rows, history=history, path_scores=path_scores,
                                             all_real=all_real, return_hidden=self.mtp is not None)
        if self.mtp is not None:  # (every pass's hidden states: what the MTP layers read)
            out, hidden = out
            self.mtp.store(seqs, host_pos, host_mask, hidden)
        logits = out.cpu()
        if count:
            self._count(phase, len(seqs), int(mask.sum()), time.perf_counter() - start)
        return logits

    def _captured_pass(self, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
                       count: bool = True, path_scores: torch.Tensor | None = None) -> torch.Tensor:
        """A decode pass padded for its captured step: ids/pos int64 [B, 1] -> logits fp32 [B, 1, V] (the real
        rows'). Padding row i copies row ``source[i]`` (0) of the pass: its token, position, cache row, history
        (and path scores [B, L, E], when given). ``count``: into the stats and the listener (not the warm-up's)."""
        dev, B = self.device, len(seqs)
        source = torch.tensor(list(range(B)) + [0] * (padded_batch(B) - B), dtype=torch.long)
        view = self.cache.decode_view(len(source), key_bucket(int(pos.max()) + 1, self.cache.max_len))
        rows = torch.tensor([seqs[i].row for i in source.tolist()], dtype=torch.long)
        view.load(rows, source)
        ids, pos = ids[source], pos[source]
        mask = torch.ones_like(ids, dtype=torch.bool)
        history = self.history.feed(rows.tolist(), ids, pos, mask) if self.history is not None else None
        ids, pos, mask = ids.to(dev), pos.to(dev), mask.to(dev)
        self.model.stats.set_phase("decode")
        start = time.perf_counter()
        if path_scores is not None:
            path_scores = path_scores[source]
        logits = self.model.runner.forward_pass(ids, pos, view, pos, mask, "decode", rows=view.rows,
                                                history=history, path_scores=path_scores, all_real=True)
        logits = logits[:B].cpu()  # (the step's static buffer on the CPU: read before the step's next replay)
        if count:
            self._count("decode", B, B, time.perf_counter() - start)
        return logits

    def _count(self, phase: str, batch: int, tokens: int, seconds: float) -> None:
        """One pass into the model's stats and the listener: ``batch`` sequences, ``tokens`` real tokens."""
        current = self.model.stats.current()
        current.steps += 1
        current.tokens += tokens
        current.time_s += seconds
        self.listener.on_pass(phase, batch, tokens, seconds)

    def _emit(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Record and report ``token`` (logits fp32 [V] it was chosen from); finish ``seq`` when it ends there."""
        reason = self._record(seq, token, logits)
        if reason is not None:
            self._finish(seq, reason)

    def _record(self, seq: Sequence, token: int, logits: torch.Tensor) -> str | None:
        """Record and report ``token``; logits fp32 [V] it was chosen from (for log-probabilities). Returns the
        finish reason it ends ``seq`` with ("stop", "length"), or None; the caller finishes it."""
        if seq.params.logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)  # of the model's distribution, before sampling
            top = torch.topk(logp, min(seq.params.logprobs, logp.shape[-1]))
            seq.logprobs.append((float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist(),
                                                               strict=True))))
        now = time.perf_counter()
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.generated.append(token)
        seq.on_event(token, None)
        if token in seq.params.stop_token_ids or (seq.stop_check is not None and seq.stop_check(seq.generated)):
            return "stop"
        return "length" if len(seq.generated) >= seq.params.max_new_tokens else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.done:
            return
        seq.finish_reason = reason
        if seq.row is not None:
            self.cache.release(seq.row)
            if self.prefix is not None:  # its keys stay for a later prompt that starts the same way
                self.prefix.store(seq.row, seq.fed_tokens() if reason != "error" else [])
            seq.row = None
        if seq in self._running:
            self._running.remove(seq)
        seq.on_event(None, reason)
        self.listener.on_finish(seq)
