"""Slot experts computed with torch's CPU int4 kernels (``kernels="cpu-int4"`` with an offloading policy on the CPU).

The slot pool holds AWQ bytes like on a GPU; the int4 kernels need their own packed form. Each slot's form is
converted from the slot's bytes the first time the slot is computed after a new expert landed in it, and kept
until another expert takes the slot: with every expert fitting in the pool the conversions happen once, at the
warm start. The numerics are :class:`~moeflow.moe.resident.CpuInt4Experts`' (same forms of the same bytes, same
rows per expert), so the tokens equal the resident CPU int4 path's.
"""

from __future__ import annotations

import torch

from moeflow.kernels.pool import ExpertPool


class SlotInt4Forms:
    """Per-slot :class:`~moeflow.kernels.cpu_int4.Int4Expert` forms of a CPU slot pool."""

    def __init__(self, pool: ExpertPool) -> None:
        from moeflow.kernels.cpu_int4 import Int4Expert

        if pool.fmt.kind != "awq" or pool.device.type != "cpu":
            raise ValueError(f"kernels='cpu-int4' computes AWQ experts in a CPU slot pool, got {pool.fmt.kind!r} "
                             f"experts on {pool.device}")
        self.pool = pool
        self._make = Int4Expert.from_awq_tensors
        self._forms: dict[int, tuple[tuple[int, int], object]] = {}  # slot -> (key it was converted for, form)
        self.conversions = 0

    def form(self, slot: int, key: tuple[int, int]):
        held = self._forms.get(slot)
        if held is None or held[0] != key:
            fmt = self.pool.fmt
            if hasattr(fmt, "awq_tensors"):  # the pool holds the GPU kernels' layout: its exact inverse
                tensors = fmt.awq_tensors(self.pool.buffer[slot])
            else:
                tensors = {name: t[slot] for name, t in self.pool.tensors.items()}
            held = self._forms[slot] = (key, self._make(tensors, fmt.group_size))
            self.conversions += 1
        return held[1]

    def compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor, experts: list[int], slots: list[int]) -> None:
        """Fill the ``out [T*k, H]`` rows of ``experts`` (their slots ``slots``): x [T, H], topk_ids [T, k],
        topk_weights fp32 [T, k]."""
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        flat_w = topk_weights.reshape(-1).float()
        for e, slot in zip(experts, slots, strict=True):
            pairs = torch.nonzero(flat_ids == e).squeeze(1)
            out[pairs] = self.form(slot, (layer, e)).forward(x[pairs // k], flat_w[pairs])
