"""Every expert of every layer in one host buffer, one contiguous region per (layer, expert).

A region is byte-identical to a device slot (:class:`moeflow.kernels.pool.ExpertFormat`), so moving an
expert is one copy (or a few byte-range chunks). On a CPU device with the int4 kernels the format is
:class:`~moeflow.offload.cpu_slots.CpuInt4Format`: every expert converted to torch's int4 layout once, as it is
written here, so a CPU slot computes the very bytes it was copied. Hybrid compute's CPU form of an expert
(:meth:`HostStore.cpu_expert`) is views of its region where the CPU kernels read the stored layout (GGUF,
CpuInt4Format), else a converted copy kept beside it (AWQ, MXFP4). For CUDA the buffer is page-locked at its exact size
with ``cudaHostRegister``: PyTorch's pinned allocator rounds every block up to a power of two (an 87 MiB
Mixtral expert would take 128 MiB, 32 GiB for the model instead of 22). If registration fails (memlock
limits, containers, WSL) the store stays pageable and says once what that costs.
"""

from __future__ import annotations

import warnings

import torch

from moeflow.kernels.cpu import hugepages
from moeflow.kernels.formats import ExpertFormat

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one


class HostStore:
    """``uint8 [num_layers * num_experts, fmt.nbytes]`` host buffer; row ``layer * E + expert``."""

    def __init__(
        self, fmt: ExpertFormat, num_layers: int, num_experts: int, *, pin: bool, device: torch.device | str
    ) -> None:
        self.fmt = fmt
        self.num_layers = num_layers
        self.num_experts = num_experts
        # torch.empty on the host never zero-fills, so the only full-size copy of the model is this one; for the CPU
        # kernels (device="cpu") on huge pages (kernels/cpu/hugepages.py), not where it is pinned for a GPU's copies
        shape = (num_layers * num_experts, fmt.nbytes)
        self.buffer = hugepages.empty(shape, torch.uint8) if torch.device(device).type == "cpu" else \
            torch.empty(shape, dtype=torch.uint8)
        self.pinned = False
        self._registered_ptr: int | None = None
        self.loaded = torch.zeros(num_layers * num_experts, dtype=torch.bool)
        self._gaps = self._alignment_gaps(fmt)
        if pin and torch.device(device).type == "cuda":
            self._pin()
        # hybrid execution: each expert's CPU form, built on first use, then kept: views of the region where the
        # format's CPU kernels read its layout (GGUF blocks, CpuInt4Format), else a converted copy (AWQ, MXFP4)
        self._cpu_forms: dict[int, object] = {}
        self._cpu_views: dict[int, object] = {}

    @staticmethod
    def _alignment_gaps(fmt: ExpertFormat) -> list[tuple[int, int]]:
        """Alignment gaps between tensors, zeroed on write so a region's bytes are fully determined."""
        gaps, end = [], 0
        for spec in fmt.specs:
            if spec.offset > end:
                gaps.append((end, spec.offset))
            end = spec.offset + spec.nbytes
        if fmt.nbytes > end:
            gaps.append((end, fmt.nbytes))
        return gaps

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    # the disk tier's hooks (moeflow/offload/disk_store.py); every expert is in host memory here
    on_disk = False

    def stage(self, layer: int, expert: int) -> bool:
        """Is the expert in host memory now (a prefetch may copy it)? Always, for this store."""
        return True

    def stage_all(self, layer: int, experts) -> None:
        """Start reading a layer's misses into host memory: nothing to read here."""

    def pin(self) -> bool:
        """Register the buffer's pages with CUDA (page-locked: copies at full bandwidth, overlapping compute);
        a no-op when already pinned. Returns whether it is pinned (a failure warns and leaves it pageable).
        For a store that outlives the backend that closed (unregistered) it and is handed to another one."""
        if self._registered_ptr is None:
            self._pin()
        return self.pinned

    def _pin(self) -> None:
        ptr, size = self.buffer.data_ptr(), self.buffer.numel()
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE))
        except Exception as exc:  # no CUDA runtime, or torch built without cudart bindings
            err, detail = -1, f"{type(exc).__name__}: {exc}"
        else:
            detail = f"cudaError {err}"
        if err == 0:
            self.pinned, self._registered_ptr = True, ptr
            return
        warnings.warn(
            f"moeflow: could not pin the {size / 2**30:.2f} GiB expert host store ({detail}; often the "
            "locked-memory limit, `ulimit -l`, or a container cap). Continuing with pageable memory: every "
            "expert copy then goes through a driver staging buffer, typically at half the pinned bandwidth "
            "or less, and copies no longer overlap compute.",
            RuntimeWarning,
            stacklevel=3,
        )

    def index(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(
                f"expert ({layer}, {expert}) outside the host store ({self.num_layers} layers x {self.num_experts})"
            )
        return layer * self.num_experts + expert

    def region(self, layer: int, expert: int) -> torch.Tensor:
        """The ``uint8 [fmt.nbytes]`` region of one expert (a view, no copy)."""
        return self.buffer[self.index(layer, expert)]

    def write(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store one expert's tensors (names of ``fmt``) straight into its region."""
        i = self.index(layer, expert)
        self.fmt.write(self.buffer[i], tensors)
        for a, b in self._gaps:
            self.buffer[i, a:b].zero_()
        self.loaded[i] = True
        self._cpu_forms.pop(i, None)
        self._cpu_views.pop(i, None)

    def cpu_expert(self, layer: int, expert: int):
        """The expert's CPU form (its format's ``cpu_expert``: torch int4 for AWQ, the stored blocks for MXFP4 and
        GGUF).

        Where the format's CPU kernels read the region's layout as stored (:meth:`ExpertFormat.cpu_region_expert`:
        GGUF blocks, MXFP4 blocks and scales (``kernels/cpu/mxfp4.c``), a
        :class:`~moeflow.offload.cpu_slots.CpuInt4Format` store on the CPU device) the form is views of the region:
        no copy, no extra RAM (a region is written once, at load, so nothing overwrites it while a CPU job reads
        it). Other formats convert on first use and keep the form: about 1.01x the expert's AWQ bytes (MXFP4
        without moeflow's C kernels: torch int4 digits, 2.35x) of extra RAM per converted expert
        (:attr:`cpu_nbytes`; ``benchmarks/host/cpu_form_rss.py``). Thread-safe: two threads building the same
        expert's form at once both succeed, one is kept.
        """
        i = self.index(layer, expert)
        form = self._cpu_views.get(i)
        if form is not None:
            return form
        form = self._cpu_forms.get(i)
        if form is not None:
            return form
        view = self.fmt.cpu_region_expert(self.buffer[i])
        if view is not None:
            return self._cpu_views.setdefault(i, view)
        return self._cpu_forms.setdefault(i, self.fmt.cpu_expert(self.fmt.loader_tensors(self.buffer[i])))

    @property
    def cpu_nbytes(self) -> int:
        """RAM held by the converted CPU forms built so far (none for views of the regions)."""
        return sum(f.nbytes for f in list(self._cpu_forms.values()))

    def missing(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs never written (the loader must fill every region)."""
        idx = torch.nonzero(~self.loaded).squeeze(1).tolist()
        return [divmod(i, self.num_experts) for i in idx]

    def close(self) -> None:
        """Unregister the pinned pages (the buffer itself is freed with the object)."""
        if self._registered_ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            finally:
                self._registered_ptr, self.pinned = None, False
