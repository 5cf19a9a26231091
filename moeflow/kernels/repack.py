"""AWQ ``qweight`` -> the K-contiguous layouts moeflow computes with, moving packed words instead of nibbles.

Both load-time conversions of a 4-bit matrix are an 8 x 8 transpose of nibbles followed by a placement of words:
8 rows of one AWQ word (8 columns, :data:`~moeflow.quant.awq.AWQ_ORDER`) become 8 words of one column each,
holding those 8 rows. The transpose is three rounds of block swaps on 32-bit words (16-bit, 8-bit, 4-bit blocks:
shift, xor, and), so no nibble is ever unpacked into its own integer:

* :func:`awq_to_panels`: the GPU pool's panel-major ``qweight [K/P, N, P/8]``
  (:mod:`moeflow.kernels.pool`), gate/up columns interleaved for w13;
* :func:`awq_to_q4_packed`: the CPU kernels' row-grouped ``uint8 [N, K/2]`` (:class:`~moeflow.kernels.cpu.q4_matrix.
  Q4Matrix`).

Likewise :func:`q4_0_to_awq`, the same transpose from the other side: a GGUF's Q4_0 rows (``[N, K]``, 32 values per
18-byte block) into AWQ's ``qweight`` / ``scales`` (GGUF Q4_0 experts as the AWQ format, at load;
tests/test_gguf_load_fast.py checks it against the unpacking reference).

Two implementations, bit-identical (tests/test_repack.py checks both against the unpacking references
:func:`moeflow.kernels.pool.to_kernel_layout_reference` and ``Q4Matrix``'s ``pack_q4``): ``mf_nibble_transpose``
(``cpu_repack.c``, one pass over the bytes, no temporaries; CPU tensors where moeflow's CPU library builds, and
it releases the GIL so loader threads convert experts in parallel) and :func:`nibble_transpose_torch` (the same
rounds on whole tensors; any device: a CUDA tensor is converted on the GPU).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.quant.awq import AWQ_ORDER, AWQ_REVERSE_ORDER

NATURAL_ROWS = (0, 1, 2, 3, 4, 5, 6, 7)  # nibble i of an output word holds row 8kb + i (the pool's panels)
Q4_ROWS = (0, 4, 1, 5, 2, 6, 3, 7)  # cpu_q4.c's words: byte j holds rows 8kb + j (low) and 8kb + 4 + j (high)


def _swap(a: torch.Tensor, b: torch.Tensor, shift: int, mask: int) -> None:
    """Exchange the bits of ``a`` selected by ``mask << shift`` with those of ``b`` selected by ``mask``."""
    t = torch.bitwise_and(torch.bitwise_xor(a >> shift, b), mask)
    a ^= t << shift  # int32 wraps: the bit pattern is what counts
    b ^= t


def nibble_transpose_torch(qweight: torch.Tensor, row_order: tuple[int, ...] = NATURAL_ROWS) -> torch.Tensor:
    """qweight int32 ``[R, C]`` (R % 8 == 0) -> int32 ``[R/8, 8, C]``: word ``(kb, i, c)`` holds, in nibble ``r``,
    nibble ``i`` of input word ``(8kb + row_order[r], c)``. Plain torch, on ``qweight``'s device."""
    rows, cols = qweight.shape
    x = qweight.reshape(rows // 8, 8, cols)
    x = x[:, list(row_order)] if tuple(row_order) != NATURAL_ROWS else x.clone()
    v = x.view(rows // 8, 2, 2, 2, cols)  # row r = 4h + 2m + l
    _swap(v[:, 0], v[:, 1], 16, 0x0000FFFF)
    _swap(v[:, :, 0], v[:, :, 1], 8, 0x00FF00FF)
    _swap(v[:, :, :, 0], v[:, :, :, 1], 4, 0x0F0F0F0F)
    return x


Library = ctypes.CDLL  # moeflow's CPU library (``moeflow.kernels.cpu.native.library()``), or None: plain torch


def _on_cpu(lib: Library | None, *tensors: torch.Tensor) -> bool:
    return lib is not None and all(t.device.type == "cpu" for t in tensors)


def _check(qweight: torch.Tensor, what: str) -> None:
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] % 8:
        raise ValueError(f"{what}: qweight must be int32 [K, N/8] with K % 8 == 0, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")


def _run_native(lib: Library, qweight: torch.Tensor, row_order: tuple[int, ...], col_off: torch.Tensor,
                k_off: torch.Tensor, out: torch.Tensor) -> None:
    """``mf_nibble_transpose`` (cpu_repack.c): col_off int64 [N] (input word c, nibble i at 8c + i), k_off int64
    [K/8], word offsets in ``out``."""
    q = qweight.contiguous()
    if out.numel() * out.element_size() // 4 >= 2**31:
        raise ValueError(f"awq repack: one matrix of {out.numel() * out.element_size()} bytes is beyond the "
                         "CPU converter's int32 offsets (8 GiB)")
    col_t = _column_table(col_off)
    order = (ctypes.c_int32 * 8)(*row_order)
    p = ctypes.c_void_p
    lib.mf_nibble_transpose(p(q.data_ptr()), ctypes.c_int64(q.shape[0]), ctypes.c_int64(q.shape[1]),
                                  ctypes.cast(order, p),
                                  p(col_t.data_ptr()), p(k_off.data_ptr()), p(out.data_ptr()))


@lru_cache(maxsize=32)
def _column_table(col_off: torch.Tensor) -> torch.Tensor:
    """int64 [C*8] (c-major) -> int32 [8, C]: the C loop's vector of 16 columns' offsets is one load."""
    return col_off.view(-1, 8).t().to(torch.int32).contiguous()


@lru_cache(maxsize=32)
def _panel_offsets(k: int, n: int, panel: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(col_off int64 [N], k_off int64 [K/8]) of the panel layout ``[K/P, N, P/8]`` (in words)."""
    p8 = panel // 8
    col = torch.arange(n).view(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)  # input word c, nibble i -> its column
    if interleave:  # gate j -> column 2j, up j -> 2j + 1
        half = n // 2
        col = torch.where(col < half, 2 * col, 2 * (col - half) + 1)
    kb = torch.arange(k // 8)
    return (col * p8).contiguous(), ((kb // p8) * n * p8 + kb % p8).contiguous()


def awq_to_panels(qweight: torch.Tensor, panel: int, interleave: bool, out: torch.Tensor | None = None,
                  lib: Library | None = None) -> torch.Tensor:
    """AWQ qweight int32 ``[K, N/8]`` -> the pool's int32 ``[K/P, N, P/8]`` (P = ``panel``,
    :func:`moeflow.kernels.pool.awq_panel` of the group size; nibble ``i`` of word ``(p, n, j)`` is
    ``q[pP + 8j + i, n]``), w13's gate and up halves interleaved when ``interleave``. Written into ``out`` (that
    shape, contiguous) when given. ``lib``: moeflow's CPU library (CPU tensors converted in C), else torch."""
    _check(qweight, "awq_to_panels")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % panel:
        raise ValueError(f"awq_to_panels: K={k} is not a multiple of the panel {panel}")
    shape = (k // panel, n, panel // 8)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=qweight.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"awq_to_panels: out must be contiguous int32 {shape}, got {out.dtype} {tuple(out.shape)}")
    if _on_cpu(lib, qweight, out):
        _run_native(lib, qweight, NATURAL_ROWS, *_panel_offsets(k, n, panel, interleave), out)
        return out
    x = nibble_transpose_torch(qweight.to(out.device))[:, list(AWQ_REVERSE_ORDER)]  # [K/8, 8, C] natural columns
    cols = x.permute(0, 2, 1).reshape(k // 8, n)  # [K/8, N]
    if interleave:
        cols = cols.view(k // 8, 2, n // 2).transpose(1, 2).reshape(k // 8, n)
    out.copy_(cols.view(k // panel, panel // 8, n).transpose(1, 2))
    return out


def awq_to_q4_packed(qweight: torch.Tensor, out: torch.Tensor | None = None, lib: Library | None = None
                     ) -> torch.Tensor:
    """AWQ qweight int32 ``[K, N/8]`` -> ``Q4Matrix.packed`` uint8 ``[N, K/2]`` (rows in groups of 8, cpu_q4.c's
    layout; N is a multiple of 8, so there is no plain tail). Written into ``out`` when given. ``lib``: moeflow's
    CPU library (CPU tensors converted in C), else torch."""
    _check(qweight, "awq_to_q4_packed")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % 32:
        raise ValueError(f"awq_to_q4_packed: K={k} is not a multiple of 32 (the CPU kernels' block)")
    if out is None:  # (on the CPU: a weight form, on huge pages)
        out = hugepages.empty((n, k // 2), torch.uint8) if qweight.device.type == "cpu" else \
            torch.empty((n, k // 2), dtype=torch.uint8, device=qweight.device)
    elif tuple(out.shape) != (n, k // 2) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"awq_to_q4_packed: out must be contiguous uint8 {(n, k // 2)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if _on_cpu(lib, qweight, out):
        q = qweight.contiguous()
        p = ctypes.c_void_p
        rows, pos = (ctypes.c_int32 * 8)(*Q4_ROWS), (ctypes.c_int32 * 8)(*AWQ_ORDER)
        lib.mf_nibble_transpose_grouped(p(q.data_ptr()), ctypes.c_int64(k), ctypes.c_int64(n // 8),
                                              ctypes.cast(rows, p), ctypes.cast(pos, p), ctypes.c_int64(k),
                                              p(out.data_ptr()))
        return out
    x = nibble_transpose_torch(qweight, Q4_ROWS)[:, list(AWQ_REVERSE_ORDER)]  # [K/8, 8 (n % 8), N/8]
    out.view(torch.int32).view(n // 8, k // 8, 8).copy_(x.permute(2, 0, 1))
    return out


def permute_word_bits_native(lib: Library | None, words: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                             ) -> torch.Tensor | None:
    """``lo[w & 0xFFFF] | hi[w >> 16]`` of every word of ``words`` (contiguous int32 [n]; lo, hi int32 [65536])
    in one pass of ``mf_permute_word_bits``; None off the CPU or without moeflow's CPU library (``lib`` None: the
    caller then does the same lookups with torch). The MXFP4 blocks' conversion into the kernel layout at load."""
    if not _on_cpu(lib, words) or not words.is_contiguous():
        return None
    out = torch.empty_like(words)
    p = ctypes.c_void_p
    lib.mf_permute_word_bits(p(words.data_ptr()), ctypes.c_int64(words.numel()), p(lo.data_ptr()),
                                   p(hi.data_ptr()), p(out.data_ptr()))
    return out


def quantize_rows_int8_native(lib: Library | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` fp32 ``[rows, cols]`` -> (int8 ``[rows, cols]``, bf16 scales ``[rows]``): per row s = bf16(max(max|w| /
    127, 1e-8)), q = clamp(round(w / s), -127, 127), in one pass of ``mf_quantize_rows_int8`` (bit for bit the
    torch expression in :func:`moeflow.kernels.cpu.quant_linear.quantize_linear_cpu`); None off the CPU or
    without moeflow's CPU library."""
    if not _on_cpu(lib, w) or w.dtype != torch.float32 or w.dim() != 2:
        return None
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.bfloat16)
    p = ctypes.c_void_p
    lib.mf_quantize_rows_int8(p(w.data_ptr()), ctypes.c_int64(w.shape[0]), ctypes.c_int64(w.shape[1]),
                                    p(scales.data_ptr()), p(q.data_ptr()))
    return q, scales


_ROW_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # repack.c's MF_ROWS_*


def quantize_rows_int8_grouped_native(lib: Library | None, w: torch.Tensor, threads: int = 1
                                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` fp32, fp16 or bf16 ``[rows, cols]`` (cols % 32 == 0) -> (int8 ``[rows, cols]`` in q8.c's row groups,
    bf16 scales ``[rows]``): :func:`quantize_rows_int8_native` of ``w.float()`` followed by
    :class:`~moeflow.kernels.cpu.q8_matrix.Q8Matrix`'s row grouping, bit for bit, in one pass of
    ``mf_quantize_rows_int8_grouped`` (each row widened to fp32 in a row buffer: no fp32 copy of the matrix, no
    plain-row int8 copy), over ``threads`` threads. None off the CPU, for another dtype, or without moeflow's
    CPU library."""
    if not _on_cpu(lib, w) or w.dtype not in _ROW_KINDS or w.dim() != 2 or w.shape[1] % 32:
        return None
    w = w.contiguous()
    q = hugepages.empty(w.shape, torch.int8)  # the weight form itself (the lm_head's, the attention's)
    scales = torch.empty(w.shape[0], dtype=torch.bfloat16)
    p = ctypes.c_void_p
    if lib.mf_quantize_rows_int8_grouped(p(w.data_ptr()), ctypes.c_int(_ROW_KINDS[w.dtype]),
                                         ctypes.c_int64(w.shape[0]), ctypes.c_int64(w.shape[1]),
                                         p(scales.data_ptr()), p(q.data_ptr()), ctypes.c_int(max(threads, 1))):
        raise MemoryError("quantize_rows_int8_grouped_native: the CPU kernel could not allocate its row buffers")
    return q, scales


def q4_0_to_awq(raw: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, lib: Library | None = None) -> None:
    """Q4_0 rows -> AWQ's ``qweight`` and ``scales`` (group 32, zero point 8, the same codes and fp16 scales),
    moving packed words. raw: uint8 ``[N, K/32 * 18]`` (N % 8 == 0, contiguous rows of Q4_0 blocks: fp16 ``d``,
    16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31); written into qweight int32 ``[K, N/8]``
    (word ``(k, c)``, nibble ``i``: code of row ``8c + AWQ_ORDER[i]``, element ``k``) and scales fp16 ``[K/32, N]``,
    which may be column slices of wider tensors (w13's gate and up halves: unit stride along the row). ``lib``:
    moeflow's CPU library (``mf_q4_0_to_awq`` in cpu/repack.c, GIL released), else the same word transposes in
    torch (:func:`nibble_transpose_torch`)."""
    n = raw.shape[0]
    k = raw.shape[1] // 18 * 32 if raw.dim() == 2 else -1
    if (raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % 18 or n % 8
            or tuple(qweight.shape) != (k, n // 8) or qweight.dtype != torch.int32
            or tuple(scales.shape) != (k // 32, n) or scales.dtype != torch.float16):
        raise ValueError(f"q4_0_to_awq: raw must be uint8 [N, K/32 * 18] with N % 8 == 0, qweight int32 [K, N/8], "
                         f"scales fp16 [K/32, N]; got raw {raw.dtype} {tuple(raw.shape)}, qweight {qweight.dtype} "
                         f"{tuple(qweight.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
    if k == 0 or n == 0:
        return
    if qweight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("q4_0_to_awq: qweight and scales need unit stride along their rows")
    if _on_cpu(lib, raw, qweight, scales):
        r = raw.contiguous()
        order = (ctypes.c_int32 * 8)(*AWQ_ORDER)
        p = ctypes.c_void_p
        lib.mf_q4_0_to_awq(p(r.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(k), ctypes.cast(order, p),
                           p(qweight.data_ptr()), ctypes.c_int64(qweight.stride(0)), p(scales.data_ptr()),
                           ctypes.c_int64(scales.stride(0)))
        return
    blocks = raw.reshape(n, k // 32, 18)
    qs = blocks[:, :, 2:].contiguous().view(torch.int32).view(n, k // 8)  # word 4b + ww, nibble 2j + h
    x = nibble_transpose_torch(qs, AWQ_ORDER)  # [N/8, 8 (nibble 2j + h), K/8 (4b + ww)]: element 32b + 4ww + j + 16h
    qweight.copy_(x.view(n // 8, 4, 2, k // 32, 4).permute(3, 2, 4, 1, 0).reshape(k, n // 8))
    scales.copy_(blocks[:, :, :2].contiguous().view(torch.float16).view(n, k // 32).T)


def q4_0_to_q4z(raw: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lib: Library,
                rows: tuple[int, int] | None = None) -> None:
    """Q4_0 rows straight into :class:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix`'s ``Q4_F16Z8`` form (the codes and
    fp16 scales in q4.c's row-grouped layout), one pass over the stored blocks (``mf_q4_0_to_q4z`` in cpu/repack.c,
    GIL released). raw: uint8 ``[N, K/32 * 18]`` (contiguous rows of Q4_0 blocks); packed: uint8 ``[N, K/2]``;
    scales: fp16 ``[N, K/32]``, both contiguous (bit for bit ``Q4Matrix.from_q4_0`` of the unpacked codes).
    ``rows``: write only rows ``[r0, r1)`` (multiples of 8, or N), so threads may split a matrix."""
    n = raw.shape[0]
    k = raw.shape[1] // 18 * 32 if raw.dim() == 2 else -1
    if (raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % 18 or not raw.is_contiguous()
            or tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8 or not packed.is_contiguous()
            or tuple(scales.shape) != (n, k // 32) or scales.dtype != torch.float16 or not scales.is_contiguous()):
        raise ValueError(f"q4_0_to_q4z: raw must be contiguous uint8 [N, K/32 * 18], packed uint8 [N, K/2] and "
                         f"scales fp16 [N, K/32], contiguous; got raw {raw.dtype} {tuple(raw.shape)}, packed "
                         f"{packed.dtype} {tuple(packed.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
    r0, r1 = rows if rows is not None else (0, n)
    if not (0 <= r0 <= r1 <= n and r0 % 8 == 0 and (r1 % 8 == 0 or r1 == n)):
        raise ValueError(f"q4_0_to_q4z: rows {rows} of {n}: a range of whole row groups (multiples of 8, or N)")
    p = ctypes.c_void_p
    lib.mf_q4_0_to_q4z(p(raw.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int64(r0),
                       ctypes.c_int64(r1), p(packed.data_ptr()), p(scales.data_ptr()))
