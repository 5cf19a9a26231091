"""GGUF Q4_0 experts at load (engine side: the conversions run moeflow's CPU library, which :mod:`moeflow.io` may not
import; the byte ranges and the unpacking reference are in :mod:`moeflow.io.gguf.experts`).

* :func:`q4_0_awq_expert_tensors`: into the AWQ format's tensors by moving packed words (the format every backend
  of an all-Q4_0 file holds: the GPU pool, host rows, offloading slots).
* :func:`q4_0_int4_expert` and :class:`DirectQ4_0Load`: on ``device="cpu"`` with every expert resident
  (:class:`~moeflow.moe.resident.CpuInt4Experts`), straight from the stored blocks into the CPU int4 form
  (:class:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix`'s ``Q4_F16Z8``: one pass, ``mf_q4_0_to_q4z``), read from the
  mapped file (or preads when ``mmap=False``), on loader threads started before the decoder is built, so the
  conversion overlaps the non-expert load (issue 37's cold start). The result is bit for bit
  ``Int4Expert.from_awq_tensors(q4_0_awq_expert_tensors(...))`` (tests/test_gguf_q4_0_direct.py), so the tokens
  are those of the AWQ route.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moeflow.config import load_workers
from moeflow.engine.cpu_form_cache import cached_load
from moeflow.io.gguf.experts import AWQ_ZERO_8, ExpertBytes, GGUFExpertSource, check_q4_0
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.native import library, native_available
from moeflow.kernels.cpu.q4_matrix import Q4_0_GROUP, Q4Matrix
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.repack import q4_0_to_awq, q4_0_to_q4z
from moeflow.moe.resident import CpuInt4Experts


def q4_0_awq_expert_tensors(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4_0 experts as the AWQ format's tensors (group 32, zero point 8, scale ``d``), bit for bit the same weights:
    ``w13_qweight`` int32 [H, 2I/8] (gate columns, then up), ``w13_qzeros`` [H/32, 2I/8], ``w13_scales`` fp16
    [H/32, 2I]; ``w2_*`` likewise for down ([I, H/8], [I/32, H/8], [I/32, H]). The stored words are moved, not
    unpacked (:func:`moeflow.kernels.repack.q4_0_to_awq`; C where moeflow's CPU library builds);
    :func:`moeflow.io.gguf.experts.q4_0_awq_expert_tensors_reference` unpacks every code (the tests compare them)."""
    lib = library()
    out = {}
    for name, parts in (("w13", ("gate", "up")), ("w2", ("down",))):
        check_q4_0(expert, parts)
        rows = [raw[p].shape[0] for p in parts]
        n, k = sum(rows), expert.slices[parts[0]].shape[1]
        qweight = torch.empty(k, n // 8, dtype=torch.int32)
        scales = torch.empty(k // 32, n, dtype=torch.float16)
        at = 0
        for p, m in zip(parts, rows, strict=True):
            q4_0_to_awq(raw[p], qweight[:, at // 8:(at + m) // 8], scales[:, at:at + m], lib)
            at += m
        out[f"{name}_qweight"] = qweight
        out[f"{name}_qzeros"] = torch.full((k // 32, n // 8), AWQ_ZERO_8, dtype=torch.int32)
        out[f"{name}_scales"] = scales
    return out


def q4_0_int4_expert(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> Int4Expert:
    """A Q4_0 expert straight into moeflow's CPU int4 form: ``w13`` [2I, H] (gate rows, then up) and ``w2`` [H, I]
    as ``Q4_F16Z8`` :class:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix` (the stored codes and fp16 scales re-laid out
    in one pass). raw: "gate" / "up" / "down" -> uint8 [out, in/32 * 18] as stored (views of the mapped file or
    of a staging buffer). Needs moeflow's CPU library (:func:`~moeflow.kernels.cpu.native.native_available`)."""
    lib = library()
    mats = []
    for parts in (("gate", "up"), ("down",)):
        check_q4_0(expert, parts)  # (rows % 8: gate's rows end on a row group, so up's start on one)
        n, k = sum(raw[p].shape[0] for p in parts), expert.slices[parts[0]].shape[1]
        packed = hugepages.empty((n, k // 2), torch.uint8)  # (the resident form: on huge pages)
        scales = hugepages.empty((n, k // Q4_0_GROUP), torch.float16)
        at = 0
        for p in parts:
            m = raw[p].shape[0]
            q4_0_to_q4z(raw[p].contiguous(), packed[at:at + m], scales[at:at + m], lib)
            at += m
        mats.append(Q4Matrix(packed, scales, torch.empty(0, dtype=torch.uint8), Q4_0_GROUP))
    return Int4Expert(mats[0], mats[1], expert.down.shape[1])


class StoredQ4_0Reads:
    """A GGUF source's experts as their stored bytes (an index for :func:`~moeflow.engine.parallel_load.
    load_experts`): views of the mapped files when ``mapping`` is given (nothing copied; a file shorter than its
    tensor table is a CheckpointError naming it), else preads into each thread's staging buffer."""

    def __init__(self, source: GGUFExpertSource, mapping: MappedGGUF | None) -> None:
        self.source, self.mapping = source, mapping
        self.num_layers, self.num_experts = source.num_layers, source.num_experts

    def nbytes(self, layer: int, expert: int) -> int:
        return self.source.nbytes(layer, expert)

    def new_staging(self) -> torch.Tensor | None:
        return None if self.mapping is not None else self.source.new_staging()

    def read(self, layer: int, expert: int, staging: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """"gate" / "up" / "down" -> uint8 [out, row_bytes] as stored."""
        if self.mapping is None:
            assert staging is not None
            return self.source.read_raw(layer, expert, staging)
        x = self.source.expert(layer, expert)
        return {p: self.mapping.view(s.path, s.offset, s.nbytes, f"tensor {s.tensor!r} (expert {x.expert} of "
                                     f"blk.{x.block})").view(s.shape[0], -1) for p, s in x.slices.items()}

    def done(self, layer: int, expert: int) -> None:
        """The expert's bytes were converted: their pages leave the process's resident set (mapped reads;
        :meth:`~moeflow.io.gguf.mapped.MappedGGUF.release`)."""
        if self.mapping is not None:
            for s in self.source.expert(layer, expert).slices.values():
                self.mapping.release(s.path, s.offset, s.nbytes)

    def close(self) -> None:
        self.source.close()


def q4_0_direct_applies(convert: object, offload_policy: str | None, cpu_int4_experts: bool,
                        device: torch.device) -> bool:
    """Whether an all-Q4_0 GGUF model's experts go straight into the CPU int4 form: resident
    (:class:`~moeflow.moe.resident.CpuInt4Experts`: no OffloadConfig, or policy "resident") on ``device="cpu"``
    on the CPU int4 kernels, moeflow's CPU library built."""
    return convert is q4_0_awq_expert_tensors and device.type == "cpu" and cpu_int4_experts \
        and offload_policy in (None, "resident") and native_available()


def _sink(backend: CpuInt4Experts, reads: StoredQ4_0Reads):
    """The loader's sink: each expert converted, then stored whole in ``backend`` (never half an expert)."""
    def sink(layer: int, expert: int, raw: dict[str, torch.Tensor]) -> None:
        backend.experts[layer][expert] = q4_0_int4_expert(reads.source.expert(layer, expert), raw)
        reads.done(layer, expert)
    return sink


class DirectQ4_0Load:
    """An all-Q4_0 GGUF model's resident CPU experts (``backend``) loaded straight into the CPU int4 form from
    ``source`` (read through ``mapping``, else preads).

    ``start``: loader threads start now, before the decoder is built, one fewer than the load's workers
    (:func:`~moeflow.config.load_workers`: the calling thread builds the decoder meanwhile, the load's other half),
    and :meth:`finish` converts the experts still left on the calling thread beside them; else :meth:`finish` does
    the whole load (the CPU form cache's way: a hit maps the forms and converts nothing). The first error (a
    CheckpointError naming the file) stops every thread and is raised by :meth:`finish`; :meth:`close` (a failed
    or interrupted build) stops the threads after the experts in flight, waits for them and closes the source.
    An expert enters ``backend`` whole, once converted. The progress bar counts bytes (bytes/s)."""

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int, source: GGUFExpertSource,
                 mapping: MappedGGUF | None, progress: bool, start: bool) -> None:
        self.backend = CpuInt4Experts(fmt, num_layers, num_experts)
        self.reads = StoredQ4_0Reads(source, mapping)
        self.progress = progress
        self._sink = _sink(self.backend, self.reads)
        self._todo = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
        self._next, self._lock, self._stop = 0, threading.Lock(), threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._bar: tqdm | None = None
        if start:
            self._start(load_workers() - 1)

    def _start(self, threads: int) -> None:
        self._bar = tqdm(total=sum(self.reads.nbytes(*k) for k in self._todo), desc="loading experts", unit="B",
                         unit_scale=True, unit_divisor=1024, disable=not self.progress)
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"moeflow-load-q4_0-{i}")
                         for i in range(max(threads, 0))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        """Convert experts until none is left, the load stopped, or one failed (its error kept for finish)."""
        staging = self.reads.new_staging()
        while True:
            with self._lock:
                if self._stop.is_set() or self._next >= len(self._todo):
                    return
                key = self._todo[self._next]
                self._next += 1
            try:
                self._sink(*key, self.reads.read(*key, staging))
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc
                self._stop.set()
                return
            if self._bar is not None:
                self._bar.update(self.reads.nbytes(*key))

    def _join(self) -> None:
        for t in self._threads:
            t.join()
        if self._bar is not None:
            self._bar.close()

    def _load_here(self) -> None:
        if self._bar is None:
            self._start(load_workers() - 1)
        try:
            self._work()
        finally:
            self._join()
        if self._error is not None:
            raise self._error

    def finish(self, cache_files: list[Path] | None = None) -> CpuInt4Experts:
        """Every expert in ``backend``: the started load joined by this thread, else the whole load here, through
        the CPU form cache keyed by ``cache_files`` when given (:func:`~moeflow.engine.cpu_form_cache.cached_load`).
        Raises the loader's first error."""
        if self._bar is None and cache_files is not None:
            gate = self.reads.source.expert(0, 0).gate  # [I, H]
            cached_load(self.backend, cache_files, gate.shape[1], gate.shape[0], self._load_here)
        else:
            self._load_here()
        return self.backend

    def close(self) -> None:
        self._stop.set()
        self._join()
        self.reads.close()
