"""Greedy decoding of one sequence on the CPU in native chunks (issue 42): :class:`NativeDecode`.

With the one-call step (:class:`~moeflow.engine.cpu_layers.NativeLayers`, gpt-oss's
:class:`~moeflow.engine.cpu_layers_gpt_oss.NativeGptOssLayers`), a decoded token's layers, final norm and lm_head
are one native call, and 10-13 % of its wall time (0.6-1.0 ms on the peer benchmark's 8-layer model) was Python
around it: the strategy's step, ``Runner.forward_pass`` (embedding, ``begin_step``), ``CausalDecoder.forward``
(rotary, ``mark_valid``, ``attention_mask``), the step's checks, the argmax. :class:`NativeDecode` decodes several
tokens per native call instead (:func:`~moeflow.kernels.cpu.decode_loop.decode_loop`, step_loop.c): per token the
embedding row, the rotary row (computed beforehand by the decoder's own rotary module, one call per position as the
per-token path makes it), each layer's mask as the per-token path builds it (its sliding window or full attention),
the step itself (``mf_decode_step``; gpt-oss's ``mf_gptoss_decode_step``) and numpy's argmax; it stops at an EOS
id. The same numbers in the same order: the same logits bit for bit, the same tokens, the cache (k / v,
``valid``) left as the per-token path leaves it.

It is a :class:`~moeflow.moe.decode.DecodeStrategy` over the plain loop: ``generate()`` still runs its loop token
by token (the history, EOS, the stats, the streamer), and each step of :class:`NativeDecode` hands out the next token
of the running chunk, decoding a new chunk when it is empty (all the tokens left at once, up to
:data:`MAX_CHUNK`; :data:`STREAM_CHUNK` with a streamer, so it stays live). The per-step times ``generate()``
measures then fall on each chunk's first step; their mean (``stats.tpot_s``) and their sum (the phase's time)
stay right.

Taken only where the per-token path would run exactly these calls (:func:`native_decode`): batch 1, greedy (no
sampling, no repetition penalty: :func:`~moeflow.engine.sampling.next_tokens` is then numpy's argmax), the plain
loop (no micro-batches, no dual batch, no path predictor), the decoder's own forward with an fp32 ``nn.Embedding``
or a GGUF file's K-quant embedding used as stored (:func:`embed_table`), no hook on the decoder, its embedding or
its rotary, the eager step (not a compiled one), the engine's :class:`~moeflow.engine.kv_cache.StaticKVCache`, a
backend whose ``begin_step`` is the base's (the native experts; no offloading policy), and, checked again before
every chunk, the one-call step's ``loop_parts`` (:meth:`~moeflow.engine.cpu_layers.NativeLayers.loop_parts`,
:meth:`~moeflow.engine.cpu_layers_gpt_oss.NativeGptOssLayers.loop_parts`: the step enabled and taking this
backend, head and cache). Otherwise each step is the plain loop's. ``MOEFLOW_NATIVE_LOOP=0`` switches it off.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch
from torch import nn

from moeflow.engine.cpu_layers import NativeLayers
from moeflow.engine.cpu_layers_gpt_oss import NativeGptOssLayers
from moeflow.engine.decode import GenerateLoop, PlainDecode
from moeflow.engine.kv_cache import StaticKVCache
from moeflow.engine.sampling import GenerationConfig
from moeflow.engine.stored_embedding import StoredEmbedding
from moeflow.families.base import CausalDecoder
from moeflow.kernels.cpu.decode_loop import EmbedTable, LoopParts, decode_loop
from moeflow.moe.backend import ExpertBackend, StepInfo
from moeflow.moe.decode import DecodeStrategy

NATIVE_LOOP_ENV = "MOEFLOW_NATIVE_LOOP"  # "0": every decode step through the plain loop (A/B runs, tests)
STREAM_CHUNK = 4  # tokens per native call when a streamer receives them
# without one: every token left, at most this many per call (a call is not interruptible: Ctrl-C waits for its end;
# the Python between two calls, ~0.1 ms, is then < 1 us per token)
MAX_CHUNK = 256


def native_loop_enabled() -> bool:
    """Whether ``MOEFLOW_NATIVE_LOOP`` leaves the native loop on (anything but "0"; read per generate call)."""
    return os.environ.get(NATIVE_LOOP_ENV, "1") != "0"


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def embed_table(embed: nn.Module) -> EmbedTable | None:
    """The token embedding as the native loop reads it: an ``nn.Embedding`` of an fp32 contiguous CPU weight without
    ``max_norm``, or a GGUF file's K-quant table used as stored (:class:`StoredEmbedding` with its native lookup,
    fp32 out); else None (the plain loop)."""
    if type(embed) is nn.Embedding:
        w = embed.weight
        if embed.max_norm is None and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous():
            return EmbedTable(w, w.shape[1])
    elif type(embed) is StoredEmbedding and embed.native and embed.dtype == torch.float32 \
            and embed.raw.device.type == "cpu" and embed.raw.dim() == 2 and embed.raw.stride(1) == 1:
        return EmbedTable(embed.raw, embed.embedding_dim, embed.type_id)
    return None


def decoder_takes_loop(decoder: Any, decode_fn: Any) -> bool:
    """Whether the per-token pass of ``decoder`` (run as ``decode_fn``) is the one the native loop reproduces: the
    eager :class:`CausalDecoder` forward with a one-call step (:class:`NativeLayers`, :class:`NativeGptOssLayers`),
    an embedding :func:`embed_table` takes and no hook on the decoder, its embedding or its rotary."""
    if decode_fn is not decoder or not isinstance(decoder, CausalDecoder) \
            or type(decoder).forward is not CausalDecoder.forward \
            or not isinstance(decoder.layers_step, (NativeLayers, NativeGptOssLayers)):
        return False
    embed = decoder.embed_tokens
    return embed_table(embed) is not None and not _hooked(decoder, embed, decoder.rotary)


def native_decode(strategy: DecodeStrategy, loop: GenerateLoop, gen: GenerationConfig, custom_paths: bool,
                  streamer: Any) -> DecodeStrategy:
    """``strategy`` (the call's, from :func:`~moeflow.engine.decode.choose_decode`), or a :class:`NativeDecode`
    over it where the native loop gives exactly its tokens (module docstring)."""
    runner = loop.runner
    backend = runner.backend
    if not native_loop_enabled() or type(strategy) is not PlainDecode or loop.batch != 1 \
            or loop.micro_batch_size is not None or custom_paths or gen.do_sample or gen.repetition_penalty != 1.0 \
            or runner.device.type != "cpu" or type(loop.cache) is not StaticKVCache \
            or not isinstance(backend, ExpertBackend) or type(backend).begin_step is not ExpertBackend.begin_step \
            or not decoder_takes_loop(runner.decoder, runner.decode_fn):
        return strategy
    return NativeDecode(strategy, loop, gen.eos_ids(), STREAM_CHUNK if streamer is not None else MAX_CHUNK)


class NativeDecode:
    """The plain loop's steps, decoded up to ``chunk`` tokens per native call while
    :meth:`_parts` takes them (module docstring); ``eos``: the ids that end the sequence."""

    stats = None

    def __init__(self, plain: PlainDecode, loop: GenerateLoop, eos: list[int], chunk: int) -> None:
        self.plain, self.loop, self.eos, self.chunk = plain, loop, eos, chunk
        self._queue: deque[int] = deque()  # the running chunk's tokens not handed out yet
        self._next_n = -1  # the step (its ``n``) the queue's head answers
        self._ones = torch.ones((1, 1), dtype=torch.bool)

    def regroup(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        return self.plain.regroup(paths, micro_batch_size)

    def step(self, tok: torch.Tensor, next_pos: torch.Tensor, n: int, done: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The next token [1] after ``tok`` [1] (position ``next_pos`` [1], cache position n - 1) and the pass's one
        real token: from the running chunk, a new one, or the plain loop's step where the native loop steps aside."""
        if self._queue and n != self._next_n:
            raise RuntimeError(f"NativeDecode: asked for step {n} while its chunk answers step {self._next_n}")
        if not self._queue:
            self._decode(tok, next_pos, n)
        if not self._queue:
            return self.plain.step(tok, next_pos, n, done)
        self._next_n = n + 1
        return torch.tensor([self._queue.popleft()]), 1

    def _parts(self) -> LoopParts | None:
        runner = self.loop.runner
        decoder = runner.decoder
        if not decoder_takes_loop(decoder, runner.decode_fn):
            return None
        return decoder.layers_step.loop_parts(self.loop.cache, runner.backend, decoder.norm, decoder.lm_head)

    def _decode(self, tok: torch.Tensor, next_pos: torch.Tensor, n: int) -> None:
        """One chunk from ``tok`` at cache position n - 1 into the queue (nothing when the native loop steps aside)."""
        parts = self._parts()
        if parts is None:
            return
        loop, decoder = self.loop, self.loop.runner.decoder
        left = loop.hist.shape[1] - n
        count = min(self.chunk, left)
        first = int(next_pos[0])
        # the rotary rows, each from the per-token path's own call (one position [1, 1], fp32): the same bits
        rows = [decoder.rotary(torch.tensor([[p]]), torch.float32) for p in range(first, first + count)]
        cos = torch.cat([c.reshape(1, -1) for c, _ in rows])
        sin = torch.cat([s.reshape(1, -1) for _, s in rows])
        if cos.dtype != torch.float32 or cos.shape[1] != parts.kv[0][0].shape[3]:
            return  # (a partial rotary: the per-token step's checks refuse it too, pass_caches)
        # what Runner.forward_pass tells the backend before each pass (the base's begin_step: the real tokens)
        loop.runner.backend.begin_step(StepInfo(tok[:, None], next_pos[:, None], self._ones, "decode",
                                                history_ids=loop.hist[:, :n], history_mask=loop.hist_mask[:, :n],
                                                all_real=True))
        # each layer's window, as CausalDecoder.forward reads them (None: full attention)
        windows = decoder.layer_windows or [decoder.sliding_window] * len(decoder.layers)
        tokens, _ = decode_chunk(parts, embed_table(decoder.embed_tokens), cos, sin, windows, loop.cache.valid[0],
                                 n - 1, int(tok[0]), self.eos, count)
        self._queue.extend(tokens)
        self._next_n = n

    def close(self) -> None:
        self.plain.close()


def decode_chunk(parts: LoopParts, embed: EmbedTable, cos: torch.Tensor, sin: torch.Tensor,
                 windows: list[int | None], valid: torch.Tensor, cache_position: int, token: int, eos: list[int],
                 n: int, logits: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """One chunk: :func:`~moeflow.kernels.cpu.decode_loop.decode_loop` (a seam tests wrap to read each step's
    logits)."""
    return decode_loop(parts, embed, cos, sin, windows, valid, cache_position, token, eos, n, logits)
