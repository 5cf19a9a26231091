"""Greedy decoding of one sequence, several tokens per native call (step_loop.c's ``mf_decode_loop``, issue 42):
per token its embedding row (fp32, or a GGUF file's K-quant row dequantized), the one-call step with its tail
(``mf_decode_step`` for Mixtral-layout decoders, :mod:`~moeflow.kernels.cpu.layers`; ``mf_gptoss_decode_step`` for
gpt-oss, :mod:`~moeflow.kernels.cpu.gpt_oss_step`) at the next cache position under the masks
``cache.mark_valid`` + ``attention_mask`` give (each layer's sliding window or full attention), then numpy's argmax;
it stops at an EOS id. The engine's driver: :mod:`moeflow.engine.native_decode`."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.kernels.cpu.layers import HeadDesc
from moeflow.kernels.cpu.native import declared_library

_p, _i, _f, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
KINDS = {"layers": 0, "gpt_oss": 1}  # the step each token runs: mf_decode_step, mf_gptoss_decode_step


@dataclass(frozen=True)
class LoopParts:
    """What a one-call step gives the loop (``NativeLayers.loop_parts``, ``NativeGptOssLayers.loop_parts``): its
    kind (a key of :data:`KINDS`), its layers' descriptors (each with a top-k ``k``), its tail's
    (:func:`~moeflow.kernels.cpu.layers.head_desc`), each layer's (k cache, v cache fp32 [1, n_kv, L, D]) and the
    attention scores' factor the per-token step passes."""

    kind: str
    descs: ctypes.Array
    head: HeadDesc
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    scale: float


@dataclass(frozen=True)
class EmbedTable:
    """The token embedding the loop reads a row of per token: ``table`` fp32 [V, dim] (contiguous; ``type_id`` 0,
    ``nn.Embedding``'s weight), or a GGUF file's K-quant rows used as stored, uint8 [V, row_bytes] of ggml type
    ``type_id`` (Q4_K, Q5_K, Q6_K: ``engine.stored_embedding.StoredEmbedding``'s native lookup)."""

    table: torch.Tensor
    dim: int
    type_id: int = 0


def _signatures(lib: ctypes.CDLL) -> None:
    lib.mf_decode_loop.argtypes = [_i, _p, _i, _i, _i, _p, _i64, _i, _i64, _p, _p, _i, _p, _p, _p, _i, _p, _i,
                                   _i64, _i64, _f, ctypes.POINTER(HeadDesc), _p, _i, _p, _i, _i, _p, _p, _i]
    lib.mf_decode_loop.restype = _i


def decode_loop(parts: LoopParts, embed: EmbedTable, cos: torch.Tensor, sin: torch.Tensor,
                windows: Sequence[int | None], valid: torch.Tensor, cache_position: int, token: int,
                eos: Sequence[int], n: int, logits: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Up to ``n`` greedy tokens from ``token`` (the first step's input, at ``cache_position``), one native call.

    parts: the step (:class:`LoopParts`; its caches written in place); embed: the token embedding
    (:class:`EmbedTable`); cos, sin fp32 [n, D] (contiguous; row i: the rotary of step i's position);
    windows: per layer its sliding window (None: full attention); valid bool [L] (contiguous: the cache's ``valid``
    row), written; ``logits``: fp32 [n, V] to receive every step's logits, or None. Returns (the tokens, the
    times: ``time.monotonic()`` seconds at the call's start, then at each token's end)."""
    descs, head, kv = parts.descs, parts.head, parts.kv
    length, dim = kv[0][0].shape[2], kv[0][0].shape[3]
    if len(windows) != len(descs) or len(kv) != len(descs):
        raise ValueError(f"decode_loop: {len(descs)} layers, {len(kv)} caches, {len(windows)} windows")
    if cos.shape != (n, dim) or sin.shape != (n, dim) or not (cos.is_contiguous() and sin.is_contiguous()) \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"decode_loop: cos / sin must be contiguous fp32 [{n}, {dim}]")
    table = embed.table
    if table.dim() != 2 or table.device.type != "cpu" or table.stride(1) != 1 \
            or (embed.type_id == 0 and (table.dtype != torch.float32 or not table.is_contiguous()
                                        or table.shape[1] != embed.dim)) \
            or (embed.type_id != 0 and table.dtype != torch.uint8):
        raise ValueError("decode_loop: embed must be a contiguous fp32 [V, H] table or uint8 [V, row_bytes] rows")
    if valid.dtype != torch.bool or not valid.is_contiguous() or valid.numel() != length:
        raise ValueError(f"decode_loop: valid must be a contiguous bool tensor of {length} values")
    keep = logits is not None
    if keep and (logits.dtype != torch.float32 or not logits.is_contiguous() or logits.numel() != n * head.head.n):
        raise ValueError(f"decode_loop: logits must be a contiguous fp32 [{n}, {head.head.n}] tensor")
    distinct = list(dict.fromkeys(windows))
    masks = torch.empty((len(distinct), length), dtype=torch.bool)
    rows = [masks[distinct.index(w)].data_ptr() for w in windows]
    ptrs = (ctypes.c_void_p * (3 * len(kv)))(*[p for (k, v), m in zip(kv, rows, strict=True)
                                               for p in (k.data_ptr(), v.data_ptr(), m)])
    widths = torch.tensor([-1 if w is None else w for w in distinct], dtype=torch.int64)
    out = torch.empty(max(n, 1), dtype=torch.int64)
    times = torch.empty(n + 1, dtype=torch.float64)
    stops = torch.tensor(list(eos) or [0], dtype=torch.int64)
    row = logits if keep else torch.empty(head.head.n, dtype=torch.float32)
    lib = declared_library(_signatures, "the native decode loop")
    kmax = max(d.k for d in descs)
    row_bytes = table.stride(0) * table.element_size()
    rc = lib.mf_decode_loop(KINDS[parts.kind], ctypes.addressof(descs), len(descs), kmax, embed.dim,
                            table.data_ptr(), table.shape[0], embed.type_id, row_bytes, cos.data_ptr(),
                            sin.data_ptr(), dim, ptrs,
                            masks.data_ptr(), widths.data_ptr(), len(distinct), valid.data_ptr(), length,
                            cache_position, token, parts.scale, ctypes.byref(head), row.data_ptr(), int(keep),
                            stops.data_ptr(), len(eos), n, out.data_ptr(), times.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("decode_loop: the CPU kernel could not allocate its buffers")
    if rc == -3:
        raise IndexError(f"decode_loop: a token outside the embedding table ({table.shape[0]} rows) or a cache "
                         f"position past its {length}")
    if rc < 0:
        raise ValueError(f"decode_loop: the CPU kernel refused a GGUF expert's type or size, the head or the "
                         f"embedding's type (code {rc})")
    return out[:rc].tolist(), times[:rc + 1].tolist()
