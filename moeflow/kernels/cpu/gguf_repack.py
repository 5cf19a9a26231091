"""GGUF Q4_K experts repacked at load into rows interleaved 8 at a time (issue 42, session 19): :func:`repack_q4k`,
:func:`repacked_expert`, :func:`repack_experts`.

Why: gguf_k.c's row kernel spends its time on one row's 8 int32 lanes per block (decode, scale multiplies, a
horizontal sum per row); with 8 rows' codes interleaved 4 bytes at a time (``gguf_q4kx8.c``'s layout, llama.cpp's
q4_K_8x8 idea: llama.cpp repacks Q4_K this way at load on AVX2 / AVX-512, its "CPU_REPACK" buffer) the int32 lanes
of a register are 8 rows, the fp32 work is done once per block and 8 rows and no horizontal sum is left
(benchmarks/results/peers/s18/kquant_x8_proto.txt: 1.5-1.7x less compute hot, 10-16 % less time from memory).

The repacked form gives Q4_K's numbers bit for bit (``gguf.c``'s comment: since session 19 the row kernel sums a
block's lanes into one exact integer too), so a repacked expert and its mapped or copied blocks give the same
outputs: the one-call step, the per-call path, hybrid compute and the offloading policies (which keep computing the
file's blocks in their slots and host rows) agree whichever expert was repacked.

What is repacked: a Q4_K gate/up/down matrix whose row count divides by 8 (every model's so far); other types
(Q4_K_M's Q6_K / Q5_K down projections) and ragged row counts stay on the row kernel over the mapped blocks. The
copy is anonymous memory from :mod:`moeflow.kernels.cpu.hugepages` (huge pages, deferred at load) and 2.8 % larger
than the blocks (the scales unpacked to bytes). ``MOEFLOW_GGUF_REPACK=0`` in the environment turns it off (A/B).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.gguf import GGUFCpuExpert, _matrix
from moeflow.kernels.cpu.native import check_rc, declared_library
from moeflow.kernels.cpu.q4k_x8_form import Q4_K, Q4_K_X8, ROWS
from moeflow.kernels.experts.gguf_reference import GGMLType

ENV = "MOEFLOW_GGUF_REPACK"


def enabled() -> bool:
    """Whether GGUF Q4_K experts are repacked at load: ``$MOEFLOW_GGUF_REPACK`` is not ``0`` (read at each load)."""
    return os.environ.get(ENV, "1") != "0"


def _signatures(lib: ctypes.CDLL) -> None:
    lib.mf_q4k_x8_repack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_int]
    lib.mf_q4k_x8_repack.restype = ctypes.c_int


def repackable(w: torch.Tensor, t: GGMLType) -> bool:
    """Whether a matrix of block type ``t`` (``w`` uint8 [rows, row_bytes]) is repacked: Q4_K with rows % 8 == 0."""
    return t == Q4_K and w.shape[0] % ROWS == 0 and w.shape[0] > 0


def repack_q4k(w: torch.Tensor, k: int, threads: int = 1) -> torch.Tensor:
    """Q4_K rows ``w`` uint8 [N, >= k / 256 * 144] (rows of blocks, N a multiple of 8) -> the interleaved form uint8
    [N, k / 256 * 148] (contiguous: [N / 8][k / 256][1184] bytes; ``gguf_q4kx8.c``'s layout), in memory from
    :func:`moeflow.kernels.cpu.hugepages.empty`. One C pass (``threads`` OpenMP threads; loader threads call it
    with 1)."""
    stride = _matrix(w, Q4_K, k, "repack")
    if w.shape[0] % ROWS or w.shape[0] == 0:
        raise ValueError(f"repack_q4k: {w.shape[0]} rows, expected a positive multiple of {ROWS}")
    out = hugepages.empty((w.shape[0], Q4_K_X8.row_bytes(k)), torch.uint8)
    lib = declared_library(_signatures, "GGUF Q4_K experts cannot be repacked")
    check_rc(lib.mf_q4k_x8_repack(w.data_ptr(), stride, w.shape[0], k // Q4_K.block_size, out.data_ptr(), threads),
             "gguf Q4_K repack")
    return out


def repacked_expert(e: GGUFCpuExpert, threads: int = 1) -> tuple[GGUFCpuExpert, list[str]]:
    """``e`` with its repackable matrices (:func:`repackable`: Q4_K gate and up, or down) in the interleaved form,
    and the names of those repacked (the others: ``e``'s own tensors)."""
    h, inter = e.hidden_size, e.intermediate_size
    gate, up, down, t13, t2 = e.gate, e.up, e.down, e.gate_up_type, e.down_type
    done = []
    if repackable(gate, t13):
        gate, up, t13 = repack_q4k(gate, h, threads), repack_q4k(up, h, threads), Q4_K_X8
        done += ["gate", "up"]
    if repackable(down, t2):
        down, t2 = repack_q4k(down, inter, threads), Q4_K_X8
        done.append("down")
    return (GGUFCpuExpert(gate, up, down, t13, t2) if done else e), done


def repack_experts(experts: list[list[GGUFCpuExpert]], workers: int,
                   done: Callable[[int, int, list[str]], None] | None = None) -> int:
    """Every expert of ``experts[layer][expert]`` replaced by :func:`repacked_expert` (in place), ``workers`` threads
    (the C pass releases the GIL); ``done(layer, expert, names)`` is called after each one (the mapped load drops
    the pages it read). Returns the bytes of the interleaved copies made."""
    keys = [(layer, e) for layer in range(len(experts)) for e in range(len(experts[layer]))]

    def one(key: tuple[int, int]) -> int:
        layer, e = key
        form, names = repacked_expert(experts[layer][e])
        experts[layer][e] = form
        if done is not None:
            done(layer, e, names)
        mats = {"gate": form.gate, "up": form.up, "down": form.down}
        return sum(mats[n].numel() for n in names)

    if workers <= 1 or len(keys) <= 1:
        return sum(map(one, keys))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moeflow-repack") as pool:
        return sum(pool.map(one, keys))
