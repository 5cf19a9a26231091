"""GGUF experts used as stored over a mapped file (issue 37's cold start): :class:`MappedGGUFExperts`.

On ``device="cpu"`` with every expert resident, GGUF Q8_0 / Q4_K / Q5_K / Q6_K experts (Q4_K_M's and Q8_0's files)
are computed by :mod:`moeflow.kernels.cpu.gguf` on their blocks as the file stores them. Copying those blocks into
a pool at load (read, then fault in a fresh row for each expert) is all the load does for them, so here they are
not copied at all: each expert's CPU form is three views of a copy-on-write mapping of its file
(:class:`~moeflow.io.gguf.mapped.MappedGGUF`), as llama.cpp's default mmap load does. ``from_pretrained`` reads
no expert byte; a page comes from the page cache (or the disk) when a kernel first touches it, and the pages
are the page cache's own, shared with every other process that maps or reads the file.

Q4_K matrices (rows in multiples of 8) are the exception: they are repacked at load into rows interleaved 8 at a
time (:mod:`moeflow.kernels.cpu.gguf_repack`, in anonymous huge-page memory, on the load's threads; the pages read
are dropped from the process's resident set, ``MADV_DONTNEED``, and stay in the page cache): the same bits, a block
in ~0.6x the row kernel's compute, 10-13 % less CPU time per decoded token on the peer Q4_K_M file
(benchmarks/results/peers/s19/q4kx8_README.md); ``MOEFLOW_GGUF_REPACK=0`` keeps them mapped.

The numbers are those of the copied pool (:class:`~moeflow.moe.resident.ResidentExperts` with
``GGUFFormat.cpu_kernels``): the same kernels over the same bytes, grouped by
:func:`~moeflow.kernels.formats.gguf.cpu_forms_forward`, and the one-call decode step
(:mod:`moeflow.engine.cpu_layers`) takes these forms as it takes the pool's. Files whose experts are all Q4_0
are converted at load instead (the AWQ format; resident on the CPU, its int4 form ``Q4_F16Z8`` straight from the
mapped blocks, :class:`~moeflow.engine.gguf_experts.DirectQ4_0Load`: a re-laid-out copy, faster than gguf.c's
kernel on the stored Q4_0 blocks: benchmarks/results/cpu/gguf_q4_0_t1.md; a Q4_0 mixed with another type is
mapped, on that kernel), as are experts on CUDA
and under offloading policies (their slots and host rows are copies by design).
"""

from __future__ import annotations

import time

import torch

from moeflow import kernels
from moeflow.compile_boundary import host_logic
from moeflow.config import OffloadConfig, load_workers
from moeflow.io.gguf.experts import ExpertBytes, GGUFExpertSource
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.kernels.cpu import gguf_repack
from moeflow.kernels.cpu.gguf import GGUFCpuExpert
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.formats.gguf import MATRICES, GGUFFormat, cpu_forms_forward
from moeflow.moe.backend import ExpertBackend
from moeflow.offload import get_policy


class MappedGGUFExperts(ExpertBackend):
    """Every expert of a GGUF model resident on the CPU as views of its mapped file (module doc).

    fmt: the model's GGUF format with ``cpu_kernels``; source: where each (MoE layer, expert)'s matrices lie in
    the files. ``experts[layer][expert]``: the :class:`~moeflow.kernels.cpu.gguf.GGUFCpuExpert` forms. The
    mapping (:attr:`mapping`) is owned here and outlives every form (each view also holds it)."""

    def __init__(self, fmt: GGUFFormat, source: GGUFExpertSource, kernels_backend: str = "torch",
                 mapping: MappedGGUF | None = None) -> None:
        if not (isinstance(fmt, GGUFFormat) and fmt.cpu_kernels):
            raise ValueError(f"MappedGGUFExperts needs GGUF experts on the CPU kernels (GGUFFormat.cpu_kernels), "
                             f"got {fmt!r}")
        self.fmt, self.kernels_backend = fmt, kernels_backend
        self.num_layers, self.num_experts = source.num_layers, source.num_experts
        self.mapping = mapping if mapping is not None else MappedGGUF()
        stored = [[source.expert(layer, e) for e in range(self.num_experts)] for layer in range(self.num_layers)]
        self.experts: list[list[GGUFCpuExpert]] = [[self._form(x) for x in row] for row in stored]
        self.repacked_nbytes, self.repack_s = 0, 0.0  # the interleaved Q4_K copies (gguf_repack): bytes, seconds
        if gguf_repack.enabled():
            start = time.perf_counter()
            def release(layer: int, expert: int, names: list[str]) -> None:  # the mapped pages read: out of the RSS
                for name in names:
                    s = stored[layer][expert].slices[name]
                    self.mapping.release(s.path, s.offset, s.nbytes)
            self.repacked_nbytes = gguf_repack.repack_experts(self.experts, load_workers(), release)
            self.repack_s = time.perf_counter() - start

    def _form(self, x: ExpertBytes) -> GGUFCpuExpert:
        views = {}
        for name in MATRICES:
            s = x.slices[name]
            allowed = [g.name for g in self.fmt.types_of(name)]
            if s.type.name not in allowed:
                raise ValueError(f"{s.path}: {s.tensor} holds {s.type.name} blocks, not {'/'.join(allowed)} as the "
                                 "expert format was built for")
            views[name] = self.mapping.view(s.path, s.offset, s.nbytes, f"tensor {s.tensor!r} (expert "
                                            f"{x.expert} of blk.{x.block})").view(s.shape[0], -1)
        return GGUFCpuExpert(views["gate"], views["up"], views["down"], x.gate.type.name, x.down.type.name)

    def load_expert(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Replace an expert by a copy of its loader-form blocks (``gate``, ``up``, ``down`` uint8 as stored)."""
        self.experts[layer][expert] = self.fmt.cpu_expert({n: tensors[n].clone() for n in MATRICES})

    @host_logic  # host logic (reads the routing back): under torch.compile, the layer's one graph break
    def forward(self, layer, x, probs, topk_ids, topk_weights):  # noqa: D102 (see ExpertBackend)
        forms = self.experts[layer]
        out = torch.empty((topk_ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
        cpu_forms_forward(x, topk_ids, topk_weights, forms.__getitem__, out)
        return kernels.combine(out, topk_ids.shape[1], kernels.resolve_backend(self.kernels_backend, x.device))

    @property
    def nbytes(self) -> int:
        """Bytes of the experts' blocks (in the mapped files, not allocated here)."""
        return sum(f.nbytes for row in self.experts for f in row)


def mapped_experts_apply(offload: OffloadConfig, fmt: ExpertFormat, device: torch.device) -> bool:
    """Whether a GGUF model's experts are used as views of its mapped file: every expert resident on the CPU in
    the GGUF format on the CPU kernels (their form is the file's blocks). Offloading policies keep copying (slots
    and host rows are copies by design), as do CUDA and formats converted at load (Q4_0: the AWQ format, or its
    CPU int4 form)."""
    return device.type == "cpu" and isinstance(fmt, GGUFFormat) and fmt.cpu_kernels \
        and not get_policy(offload.policy).offload
