"""GGUF experts: one expert's ggml blocks as stored in the file (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K), run natively.

GGUF stacks a layer's experts in ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H,
I]`` (numpy order; llama.cpp's ``ne`` reversed): expert ``e``'s rows of each are one contiguous byte range, a row
being one output feature with its K inputs in ggml blocks (:mod:`moeflow.kernels.gguf_reference`). The region holds
those bytes unchanged, each matrix ``ALIGN``-aligned: ``gate`` uint8 ``[I, H / QK * type_size]``, ``up`` the same,
``down`` uint8 ``[H, I / QK' * type_size']``. gate and up share one block type, down may have another (Q4_K_M files
store gate/up in Q4_K and down in Q6_K or Q4_K by layer): a format is the pair :attr:`GGUFFormat.gate_up_type`,
:attr:`GGUFFormat.down_type`. The loader form is the same three tensors (the file's bytes), so :meth:`write` and
:meth:`loader_tensors` copy.

How a GGUF reader builds and fills it: ``gguf_expert_format(gate_type, down_type, hidden, inter, dtype)`` with the
``tensor_type`` of ``blk.N.ffn_gate_exps`` (must equal ``ffn_up_exps``') and ``ffn_down_exps``, and per expert
``fmt.write(region, {"gate": g[e], "up": u[e], "down": d[e]})`` where ``g`` is ``ffn_gate_exps``' data as uint8
``[E, I, row_bytes]`` (gguf-py's ``ReaderTensor.data`` is already that shape for quantized types), likewise ``u``,
``d`` (``[E, H, row_bytes]``); a disk tier reads the same three byte ranges.

Compute: SiLU gating, no biases. Backend ``"triton"``: :mod:`moeflow.kernels.gguf_experts` (grouped kernels
decoding the blocks in the K loop, one w13 kernel reading gate and up); ``"torch"``: the plain-torch reference
(:func:`moeflow.kernels.biased.biased_expert_forward_reference` over :meth:`GGUFFormat.reference_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.formats.layout import ExpertFormat
from moeflow.kernels.gguf_reference import GGML_TYPES, GGMLType, dequantize, ggml_type

if TYPE_CHECKING:
    from moeflow.kernels.formats.layout import ExpertPool, ReferenceWeights

MATRICES = ("gate", "up", "down")


@dataclass(frozen=True)
class GGUFFormat(ExpertFormat):
    """Experts as GGUF blocks (module doc). ``gate_up_type`` / ``down_type``: ggml type names (``"Q4_K"``);
    ``dtype``: the model's activation dtype (the blocks carry their own fp16 scales)."""

    gate_up_type: str = ""
    down_type: str = ""
    kind: ClassVar[str] = "gguf"
    # the fused eager MoE and CUDA-graph capture read the plain layout only; no CPU kernels yet (cpu_unsupported)

    def __post_init__(self) -> None:
        for name, t in (("gate_up_type", self.gate_up_type), ("down_type", self.down_type)):
            if not t:
                raise ValueError(f"a GGUF expert format needs {name} (one of {sorted(GGML_TYPES)}): build it with "
                                 "moeflow.kernels.formats.gguf_expert_format")
            ggml_type(t)  # a ValueError naming the supported types
        for role, g, k in (("gate/up", self.gate_up, self.hidden_size), ("down", self.down, self.intermediate_size)):
            if k % g.block_size:
                raise ValueError(f"GGUF {role} experts in {g.name} need their input size ({k}) to be a multiple of "
                                 f"{g.block_size}")
        super().__post_init__()

    @property
    def gate_up(self) -> GGMLType:
        return ggml_type(self.gate_up_type)

    @property
    def down(self) -> GGMLType:
        return ggml_type(self.down_type)

    def block_type(self, name: str) -> GGMLType:
        """The ggml type of region tensor ``name`` ("gate", "up" or "down")."""
        return self.down if name == "down" else self.gate_up

    # ---- layout -------------------------------------------------------------------------------------------
    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, torch.uint8, shape) for name, shape in self.loader_shapes().items()]

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        row13, row2 = self.gate_up.row_bytes(H), self.down.row_bytes(I)
        return {"gate": (I, row13), "up": (I, row13), "down": (H, row2)}

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one expert's blocks (``gate``, ``up``: uint8 ``[I, row_bytes]``; ``down``: ``[H, row_bytes]``) into
        its region ``uint8 [nbytes]`` (names, shapes and dtypes checked)."""
        views = self.views(region.view(1, -1))
        for name, shape in self.loader_shapes().items():
            if name not in tensors:
                raise KeyError(f"missing GGUF expert tensor {name!r} (expected {MATRICES})")
            t = tensors[name]
            if t.dtype != torch.uint8:
                raise ValueError(f"GGUF expert tensor {name!r} must be the file's bytes (uint8), got {t.dtype}")
            if tuple(t.shape) != shape:
                g = self.block_type(name)
                raise ValueError(f"GGUF expert tensor {name!r} ({g.name}) has shape {tuple(t.shape)}, expected "
                                 f"{shape} (rows, {shape[1] // g.type_size} blocks of {g.type_size} bytes)")
            views[name][0].copy_(t)

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self.views(region.view(1, -1))
        return {name: views[name][0].clone() for name in MATRICES}

    # ---- compute ------------------------------------------------------------------------------------------
    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        t = self.loader_tensors(pool.buffer[slot])
        w13 = torch.cat([dequantize(t["gate"], self.gate_up_type), dequantize(t["up"], self.gate_up_type)])
        return w13, None, dequantize(t["down"], self.down_type), None

    def check_pool(self, pool: ExpertPool) -> None:
        for name in MATRICES:
            v = pool.tensors[name]
            if v.dtype != torch.uint8 or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
                raise ValueError(f"GGUF pool tensor {name!r}: rows of blocks must be contiguous uint8")

    def forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend, *,
                config=None, validate=None):  # noqa: D102 (see ExpertFormat.forward)
        from moeflow.kernels.checks import check_expert_args, check_ids_and_slots, values_checked

        check_expert_args(x, topk_ids, topk_weights, slot_of_expert, out, expert_mask, self.hidden_size)
        if pool.device != x.device:
            raise ValueError(f"the GGUF expert pool is on {pool.device} but x is on {x.device}")
        if not pool.checked:
            self.check_pool(pool)
            pool.checked = True
        if values_checked(validate, topk_ids):
            check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)
        if topk_ids.numel() == 0:
            return out
        if backend == "triton":
            from moeflow.kernels.gguf_experts import gguf_expert_forward

            return gguf_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask,
                                       config=config)
        from moeflow.kernels.biased import biased_expert_forward_reference

        return biased_expert_forward_reference(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)

    def cpu_unsupported(self) -> str | None:
        return (f"the experts are GGUF {self.gate_up_type}/{self.down_type} blocks, which have no CPU kernels yet "
                "(hybrid compute runs AWQ 4-bit or MXFP4 experts)")
