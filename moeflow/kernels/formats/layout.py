"""The contract every expert format keeps: one expert is one contiguous byte region, typed views of it, and the
capabilities the rest of moeflow asks the format about instead of comparing names.

One expert is one contiguous byte region (so a host->device transfer is one copy, or one copy per matrix when
chunked). A pool is a ``uint8 [n_slots, nbytes]`` buffer; :meth:`ExpertFormat.views` turns it into the typed
tensors ``[n_slots, ...]`` that the kernels read. The host store uses the same format with one "slot" per
(layer, expert), so a slot and a host region are byte-identical.

The region holds the format's *kernel layout*, converted once in :meth:`ExpertFormat.write` from the tensors the
loader produces (the *loader form*: the checkpoint's tensors as published); :meth:`ExpertFormat.loader_tensors`
is its exact inverse. A format is resolved once, when the checkpoint is opened (``moeflow.kernels.formats``'
registry), and every caller then asks the object: its layout, its compute (:meth:`ExpertFormat.forward`, the
fp32 reference :meth:`ExpertFormat.reference_weights`, the CPU form :meth:`ExpertFormat.cpu_expert`) and its
capabilities (the ``ClassVar`` flags below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

ALIGN = 256  # byte alignment of every tensor inside an expert region (and of the region size)

# fp32 (W13 [2I, H] gate rows first, b13 [2I] or None, W2 [H, I], b2 [H] or None), nn.Linear orientation
ReferenceWeights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the expert region

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


def lay_out(shapes: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[tuple[TensorSpec, ...], int]:
    """(specs, region bytes): the tensors one after the other, each ``ALIGN``-aligned, the size rounded up too."""
    specs, offset = [], 0
    for name, dtype, shape in shapes:
        spec = TensorSpec(name, dtype, tuple(shape), offset)
        specs.append(spec)
        offset = -(-(offset + spec.nbytes) // ALIGN) * ALIGN
    return tuple(specs), offset


@dataclass(frozen=True)
class ExpertFormat:
    """Shapes, byte layout, compute and capabilities of one expert (abstract: one subclass per format, listed in
    ``moeflow.kernels.formats.FORMATS``). ``dtype`` is the dense weight dtype, the quantization scale dtype, or
    (MXFP4) the bias dtype; ``group_size`` the quantization group where the format has one."""

    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    group_size: int | None = None
    specs: tuple[TensorSpec, ...] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    kind: ClassVar[str] = ""  # the storage's name: messages, cache keys, the custom ops' argument
    # capabilities: what a caller may do with this format's pools
    fused_moe: ClassVar[bool] = False  # the fused eager Triton MoE (route + plan, w13, w2 + combine) reads it
    capturable: ClassVar[bool] = False  # captured_forward exists: its compute can be held by a CUDA graph
    cpu_int4: ClassVar[bool] = False  # kernels="cpu-int4" (torch's CPU int4 kernels, every expert resident) holds it
    w13_halves: ClassVar[bool] = False  # w13 is one tensor whose two byte halves may move as separate chunks
    # the gate epilogue (biased formats make these fields)
    activation: ClassVar[str] = "silu"
    bias: ClassVar[bool] = False
    swiglu_alpha: ClassVar[float] = 1.702
    swiglu_limit: ClassVar[float] = 7.0

    def __post_init__(self) -> None:
        specs, nbytes = lay_out(self.region_shapes())
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "nbytes", nbytes)

    # ---- layout -------------------------------------------------------------------------------------------
    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor of the region, in order (the kernel layout)."""
        raise NotImplementedError(f"{type(self).__name__}.region_shapes")

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the loader form (the checkpoint's tensors as published)."""
        raise NotImplementedError(f"{type(self).__name__}.loader_shapes")

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Convert one expert's loader-form tensors into the kernel layout in its region ``uint8 [nbytes]``."""
        raise NotImplementedError(f"{type(self).__name__}.write")

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Exact inverse of :meth:`write`: the loader-form tensors of one region ``uint8 [nbytes]``."""
        raise NotImplementedError(f"{type(self).__name__}.loader_tensors")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def spec(self, name: str) -> TensorSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(f"expert format {self.kind!r} has no tensor {name!r}; it has {self.names}")

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views ``name -> [n_slots, *shape]`` into ``buffer`` (``uint8 [n_slots, nbytes]``)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != self.nbytes:
            raise ValueError(
                f"expert buffer must be uint8 [n_slots, {self.nbytes}], got {buffer.dtype} {tuple(buffer.shape)}"
            )
        out = {}
        for s in self.specs:
            raw = buffer[:, s.offset : s.offset + s.nbytes]
            out[s.name] = raw.view(s.dtype).view(buffer.shape[0], *s.shape)
        return out

    # ---- compute ------------------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # int [T, k]
        topk_weights: torch.Tensor,  # fp32 [T, k]
        pool: ExpertPool,  # slots [S, ...] of this format
        slot_of_expert: torch.Tensor,  # int32 [E]
        out: torch.Tensor,  # [T*k, H], written for the pairs of selected experts only
        expert_mask: torch.Tensor | None,  # bool [E]
        backend: str,  # resolved: "torch" or "triton"
        *,
        config: dict | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """``moeflow.kernels.expert_forward`` for this format's pools (its kernel set for ``backend``)."""
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def capture_unsupported(self, backend: str) -> str | None:
        """None when :meth:`captured_forward` runs this format's pools with kernels ``backend`` (resolved: "torch"
        or "triton") in a CUDA graph, else why not."""
        if not self.capturable:
            return f"the {type(self).__name__} expert format has no captured form"
        return None

    def captured_forward(
        self,
        pool: ExpertPool,  # slots [S, ...] of this format
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # int32 [T, k]
        topk_weights: torch.Tensor,  # fp32 [T, k]
        slot_of_expert: torch.Tensor,  # int32 [E]
        expert_mask: torch.Tensor,  # bool [E]
        out: torch.Tensor,  # [T*k, H]
        backend: str,  # resolved: "torch" or "triton"
        alloc: Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor],
    ) -> Callable[[], None]:
        """:meth:`forward` over these fixed buffers as a function a CUDA graph can hold: static shapes, no host
        read, no allocation (``alloc(name, shape, dtype, device)`` gives persistent buffers; made here, outside
        any capture, with whatever the format sets up once). The offload backend's captured device part
        (:class:`moeflow.offload.device_step.DeviceGraphs`) calls it once per batch size; only where
        :meth:`capture_unsupported` is None."""
        raise NotImplementedError(f"{type(self).__name__}.captured_forward")

    def kernel_weights(self, pool: ExpertPool) -> tuple[tuple, tuple, int]:
        """(w13, w2, group_size) views of a pool as the plain kernels take them: plain formats only."""
        raise TypeError(f"the plain expert kernels read dense or AWQ pools, not {type(self).__name__}")

    def check_pool(self, pool: ExpertPool) -> None:
        """Shapes, dtypes and strides of the pool's views as the format's kernels read them (default: none)."""

    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        """fp32 weights of the expert in ``slot`` from its loader form (independent of the kernel layout)."""
        raise NotImplementedError(f"{type(self).__name__}.reference_weights")

    def dense_in(self, dtype: torch.dtype) -> bool:
        """True when the region holds unquantized weights in ``dtype``: the references then compute with
        ``nn.Linear`` semantics in that dtype, as transformers does."""
        return False

    # ---- CPU (hybrid execution) ---------------------------------------------------------------------------
    def cpu_unsupported(self) -> str | None:
        """None when hybrid execution can compute these experts on the CPU, else why not."""
        return f"the experts are {self.kind!r}, not AWQ 4-bit or MXFP4"

    def cpu_expert(self, tensors: dict[str, torch.Tensor]):  # -> Int4Expert | Mxfp4CpuExpert (kernels.cpu_*)
        """The CPU form hybrid execution computes an expert with, from its loader-form ``tensors`` (what
        :meth:`loader_tensors` gives of its host region, or a disk read)."""
        raise ValueError(f"no CPU form for {self.kind!r} experts: {self.cpu_unsupported()}")

    def cpu_region_expert(self, region: torch.Tensor):  # -> the cpu_expert form, or None
        """The CPU form of the expert in ``region`` (``uint8 [nbytes]``, on the CPU) as views of its bytes, no copy,
        where the CPU kernels read the region's layout as it is; None where they need another one (the host store
        then converts once, :meth:`cpu_expert` over :meth:`loader_tensors`). The form reads whatever the region
        holds when it computes: only for a region that is not overwritten while the form is in use (a host
        store's, written once at load; never a disk tier's reused row)."""
        return None


@dataclass
class ExpertPool:
    """A pool of expert slots on one device: typed views of a ``uint8 [n_slots, nbytes]`` buffer."""

    fmt: ExpertFormat
    buffer: torch.Tensor  # uint8 [n_slots, nbytes]
    tensors: dict[str, torch.Tensor] = field(init=False)
    checked: bool = field(default=False, init=False, repr=False)  # views validated once (they never change)

    def __post_init__(self) -> None:
        self.tensors = self.fmt.views(self.buffer)

    @classmethod
    def allocate(cls, fmt: ExpertFormat, n_slots: int, device: torch.device | str) -> ExpertPool:
        return cls(fmt, torch.empty((n_slots, fmt.nbytes), dtype=torch.uint8, device=device))

    @property
    def n_slots(self) -> int:
        return self.buffer.shape[0]

    @property
    def device(self) -> torch.device:
        return self.buffer.device
