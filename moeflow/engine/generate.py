"""Running a built model: one forward pass (:class:`Runner`), micro-batching, and the generate loop.

Every forward pass (a prefill, a decode step, or one micro-batch of either) goes through
:meth:`Runner.forward_pass`: embed the tokens, tell the backend what the pass is about
(``backend.begin_step(StepInfo)``), then run the decoder, which hands each MoE layer to the backend.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from moeflow.engine.decode import DecodeStrategyFactory, GenerateLoop, MicroBatcher, choose_decode, policy_decode
from moeflow.engine.kv_cache import PassCache, StaticKVCache
from moeflow.engine.latent_cache import new_kv_cache
from moeflow.engine.native_decode import native_decode
from moeflow.engine.sampling import GenerationConfig, next_tokens
from moeflow.engine.side_lane import Lane, ThreadLane
from moeflow.errors import InputError
from moeflow.families.base import CausalDecoder, KVCacheSpec
from moeflow.moe.backend import ExpertBackend, StepInfo
from moeflow.moe.block import RoutingRecorder
from moeflow.offload import Stats

PathPredictor = Callable[[StepInfo, bool], "torch.Tensor | None"]  # (engine.decode's)
CACHE_BUCKET = 256  # positions: a kept cache's length is a multiple of this (see cache_length)


def cache_length(needed: int, limit: int, bucket: int = CACHE_BUCKET) -> int:
    """The length of a cache kept across generate() calls (CUDA graphs) for ``needed`` positions: rounded up to
    a multiple of ``bucket``, at most ``limit`` (max_position_embeddings; never below ``needed``). Every call
    whose prompt + max_new_tokens falls in one bucket reuses the cache and its captured graphs; the positions
    past a call's tokens are masked (never valid), so they change no token. 256: the waste stays small (at
    most 255 positions attended to: the H100's decode SDPA took 40.6 us at 512 positions and 44.9 at 4096,
    ~0.3 us for 255 more, against the ~340 us a Mixtral decode layer takes; 4 KiB each per layer and sequence)
    while a chat's growing prompt, or calls with other max_new_tokens, cross a bucket only every 256 tokens
    (one capture each)."""
    return max(needed, min(-(-needed // bucket) * bucket, limit))


class Runner:
    """Forward passes of one decoder with its expert backend (``decode_fn``: the decoder, or its compiled form)."""

    def __init__(self, decoder: CausalDecoder, backend: ExpertBackend | None, stats: Stats, config: Any,
                 device: torch.device, dtype: torch.dtype,
                 kv_cache_spec: Callable[[], KVCacheSpec] | None = None) -> None:
        self.decoder, self.backend, self.stats, self.config = decoder, backend, stats, config
        # the family's choice of cache (``Family.kv_cache_spec``), asked for each new cache; None: full heads
        self.kv_cache_spec = kv_cache_spec
        self.device, self.dtype = device, dtype
        self.num_moe_layers = len(decoder.moe_blocks)
        self.num_experts = decoder.moe_blocks[0].gate.out_features
        self.decode_fn: Callable[..., torch.Tensor] = decoder
        # the counters of the last generate's decode strategy (DecodeStrategy.stats: expertflow's PipelineStats)
        self.pipeline_stats: Any = None
        # with CUDA graphs (``capture_decode``), keep the last cache for the next generate: the graphs baked its
        # addresses in; its length is rounded up to a bucket so calls of other lengths reuse it (:func:`cache_length`)
        self.reuse_cache = False
        self._last_cache: tuple[tuple, Any] | None = None  # ((batch, max_len, KVCacheSpec | None), cache)

    @property
    def decode_strategy(self) -> DecodeStrategyFactory | None:
        """The backend's policy's decode strategy (``PolicySpec.decode``: expertflow's dual-batch pipeline), or None:
        the plain loop. Asked each time: ``MoEModel.use_backend`` may swap the backend."""
        return policy_decode(self.backend)

    def close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def new_cache(self, batch: int, max_len: int, reuse: bool = True) -> StaticKVCache:
        """An empty KV cache for ``batch`` sequences of at least ``max_len`` tokens. With ``reuse_cache`` (and
        ``reuse``) its length is :func:`cache_length`'s bucket and it is the last one of that (batch, length),
        emptied (``clear()``: no valid position, linear-attention states zeroed), so the decode step captured on
        it replays; ``reuse=False``: a cache of exactly ``max_len`` that leaves the kept one alone (a prefill-only
        pass)."""
        reuse = reuse and self.reuse_cache
        if reuse:
            max_len = cache_length(max_len, self.config.max_position_embeddings)
        spec = self.kv_cache_spec() if self.kv_cache_spec is not None else None
        key = (batch, max_len, spec)  # (the family may change its cache kind: DeepSeek's latent_kv_cache)
        if reuse:
            if self._last_cache is not None and self._last_cache[0] == key:
                cache = self._last_cache[1]
                cache.clear()
                return cache
            self._last_cache = None  # (its graphs may still hold it until they are captured again)
        if spec is not None:
            cache = new_kv_cache(spec, batch, max_len, self.dtype, self.device)
        else:
            cfg = self.config
            cache = StaticKVCache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype, self.device)
        if reuse:
            self._last_cache = (key, cache)
        return cache

    def forward_pass(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: PassCache, cache_position: torch.Tensor,
        token_mask: torch.Tensor, phase: str, rows: torch.Tensor | None = None,
        history: tuple[torch.Tensor, torch.Tensor] | None = None, routing: RoutingRecorder | None = None,
        path_scores: torch.Tensor | None = None, last_only: bool = False, all_real: bool = False,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ids/positions/token_mask [B, T] (the rows ``rows`` of the batch, when a micro-batch), cache_position [T]
        -> logits fp32 [B, T, V] ([B, 1, V] with ``last_only``). ``history``: (ids, mask) [B, S] of every token
        so far, for the backend; ``path_scores`` [B, L, E]: routing-path scores predicted ahead (the dual-batch
        pipeline's); ``all_real``: the caller knows token_mask is all True (``StepInfo.all_real``).
        ``return_hidden``: (logits [B, T, V], the final norm's output [B, T, H]), from the eager decoder (what
        multi-token-prediction layers read)."""
        embeds = self.decoder.embed_tokens(ids)
        hist_ids, hist_mask = history if history is not None else (None, None)
        self.backend.begin_step(StepInfo(ids, positions, token_mask, phase, rows, embeds, hist_ids, hist_mask,
                                         path_scores, all_real))
        if return_hidden:
            return self.decoder(embeds, positions, cache, cache_position, token_mask, self.backend, routing,
                                return_hidden=True)
        # the compiled step takes no recorder (micro-batched steps run eagerly: they leave the graph anyway)
        fn = self.decode_fn if phase == "decode" and routing is None else self.decoder
        if last_only and fn is self.decoder:  # (the compiled one-token step has one position anyway)
            return fn(embeds, positions, cache, cache_position, token_mask, self.backend, routing, last_only=True)
        return fn(embeds, positions, cache, cache_position, token_mask, self.backend, routing)


def deprecated_path_predictor(path_predictor: Any) -> PathPredictor:
    """``generate(path_predictor=obj)``: obj.predict_paths(ids, mask, last_only=...) (before the backend asked)."""
    warnings.warn("generate(path_predictor=...) is deprecated: micro-batches are grouped by the expert backend's "
                  "predict_paths (the expertflow policy provides it)", DeprecationWarning, stacklevel=4)

    # the backend's own predictors (``model.experts.predictor``) take the StepInfo; older objects take ids and mask
    takes_step = next(iter(inspect.signature(path_predictor.predict_paths).parameters), None) == "step"

    def predict(step: StepInfo, last_only: bool) -> torch.Tensor | None:
        if takes_step:
            return path_predictor.predict_paths(step, last_only=last_only)
        return path_predictor.predict_paths(step.history_ids, step.history_mask, last_only=last_only)

    return predict


def generate(
    runner: Runner, gen: GenerationConfig, input_ids: torch.Tensor, token_mask: torch.Tensor, *,
    streamer: Any = None, seed: int | None = None, micro_batch_size: int | None = None,
    predict_paths: PathPredictor | None = None, dual_batch: bool | None = None, lane: Lane | None = None,
) -> torch.Tensor:
    """The generate loop (arguments checked by the caller): input_ids/token_mask [B, T] on the device ->
    [B, T + n] ids. ``predict_paths`` (default: the backend's) groups micro-batches before each step.
    The decode steps run through a strategy (:func:`~moeflow.engine.decode.choose_decode`): the policy's where
    ``dual_batch`` asks for it (expertflow's dual-batch pipeline, its side work on ``lane``, default a
    :class:`ThreadLane`; an :class:`InlineLane` runs the same work without the overlap), else the plain loop
    (greedy batch-1 steps on the CPU's one-call step in native chunks: :mod:`moeflow.engine.native_decode`)."""
    stats, device = runner.stats, runner.device
    b, t = input_ids.shape
    custom_paths = predict_paths is not None
    runner.pipeline_stats = None
    predict_paths = predict_paths or runner.backend.predict_paths
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos = torch.tensor(gen.eos_ids(), dtype=torch.long, device=device)
    pad = gen.pad_token_id if gen.pad_token_id is not None else (gen.eos_ids() or [0])[0]

    if streamer is not None:
        streamer.put(input_ids.cpu())
    total = t + gen.max_new_tokens
    cache = runner.new_cache(b, total)
    # every token so far, cache-aligned (column j = cache position j): what path predictors read
    hist = torch.zeros((b, total), dtype=torch.long, device=device)
    hist_mask = torch.zeros((b, total), dtype=torch.bool, device=device)
    hist[:, :t], hist_mask[:, :t] = input_ids, token_mask
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    positions = positions_from_mask(token_mask)
    stats.ttft_s = stats.tpot_s = None
    start = time.perf_counter()
    decode_times: list[float] = []
    if gen.max_new_tokens == 0:
        return input_ids

    def pick(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [b, V] of ``rows`` [b] -> their next tokens [b] (padding once a row finished)."""
        seen = None
        if gen.repetition_penalty != 1.0:  # the row's real tokens so far (padding: its last token, always real)
            seen = torch.where(hist_mask[rows, :n], hist[rows, :n], hist[rows, n - 1:n])
        tok = next_tokens(logits, gen, generator, seen)
        return torch.where(finished[rows], torch.full_like(tok, pad), tok)

    lanes: list[Lane] = []

    def side_lane() -> Lane:
        if not lanes:
            lanes.append(lane or ThreadLane(device))
        return lanes[0]

    loop = GenerateLoop(runner, cache, hist, hist_mask, finished, micro_batch_size, pick, side_lane)
    strategy = choose_decode(loop, dual_batch, predict_paths, custom_paths)
    # greedy batch-1 CPU decoding in native chunks where it gives the plain loop's tokens (engine.native_decode)
    strategy = native_decode(strategy, loop, gen, custom_paths, streamer)
    batcher = loop.batcher = MicroBatcher(runner, b, micro_batch_size, strategy.regroup)
    if micro_batch_size is not None:
        paths = predict_paths(StepInfo(input_ids, positions, token_mask, "prefill", history_ids=input_ids,
                                       history_mask=token_mask), False)
        if paths is not None:
            batcher.regroup(paths)
    stats.set_phase("prefill")
    logits = batcher.run(input_ids, positions, cache, torch.arange(t, device=device), token_mask, "prefill",
                         (hist[:, :t], hist_mask[:, :t]))
    pass_tokens = int(token_mask.sum())  # real tokens of the pass just run (the stats count no padding)
    next_pos = positions[:, -1] + 1
    n = t
    tok = pick(logits, torch.arange(b, device=device))
    for step in range(gen.max_new_tokens):
        hist[:, n], hist_mask[:, n] = tok, True
        n += 1
        if eos.numel():
            finished |= torch.isin(tok, eos)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phase = stats.current()
        phase.steps += 1
        phase.tokens += pass_tokens
        phase.time_s += now - start
        if step == 0:
            stats.ttft_s = now - start
        else:
            decode_times.append(now - start)
        if streamer is not None:
            streamer.put(tok.cpu())
        done = finished.cpu()  # the step's one read of the finished rows
        if step + 1 == gen.max_new_tokens or bool(done.all()):
            break
        start = time.perf_counter()
        stats.set_phase("decode")
        tok, pass_tokens = strategy.step(tok, next_pos, n, done)
        next_pos = next_pos + 1
    strategy.close()
    runner.pipeline_stats = strategy.stats
    if lane is not None and not lanes:  # a lane the strategy never took
        lane.close()
    if decode_times:
        stats.tpot_s = sum(decode_times) / len(decode_times)
    if device.type == "cuda":
        stats.peak_gpu_bytes = max(stats.peak_gpu_bytes, torch.cuda.max_memory_allocated(device))
    if streamer is not None:
        streamer.end()
    return hist[:, :n]


def positions_from_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """Position ids from a left-padded mask [B, T]: count of real tokens so far minus one (0 on padding)."""
    return (token_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_inputs(input_ids: Any, attention_mask: torch.Tensor | None, vocab_size: int, max_positions: int) -> None:
    """InputError naming what is wrong with ``input_ids`` [B, T] / ``attention_mask`` [B, T]."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InputError(f"input_ids must be a [batch, seq] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise InputError("input_ids is empty: the prompt needs at least one token")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if input_ids.shape[1] > max_positions:
        raise InputError(f"input_ids has {input_ids.shape[1]} tokens, longer than max_position_embeddings="
                         f"{max_positions}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise InputError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """generate() takes left-padded batches: 0/1 masks, every row's real tokens at its end, at least one each."""
    m = attention_mask.detach().cpu()
    if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
        raise InputError("attention_mask must hold 0 (padding) or 1 (real token)")
    m = m != 0
    empty = (~m.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask marks no real token in row(s) {empty[:8]}: every prompt needs at least one")
    right = (m[:, :-1] & ~m[:, 1:]).any(dim=1).nonzero().flatten().tolist()
    if right:
        raise InputError(f"attention_mask row(s) {right[:8]} have padding after a real token: generate() expects "
                         "left padding (padding first, the prompt's tokens at the end of the row)")
