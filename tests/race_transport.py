"""The GPU race harness (issue 12): a :class:`~moeflow.offload.CudaTransport` that makes every missing wait visible.

On the copy stream, after the waits a copy must honour (``after``: the compute that last read the slot), each chunk

1. poisons its destination with 0xFF bytes (NaN in every float dtype a slot holds: scales, dense weights; wild
   nibbles in AWQ words), the slot an eviction just freed;
2. sleeps ``sleep_cycles`` GPU clocks (``torch.cuda._sleep``): the copy lands late;
3. copies the chunk.

With every wait in place the compute never sees the poison, so each layer's MoE output is bitwise the resident
backend's. ``drop`` deletes one ``wait_event`` to show that the harness catches it:

* ``"compute-wait"``: the compute stream does not wait for the copies of the experts it is about to read
  (``wait_compute`` returns at once): the kernels read poison or half-written slots;
* ``"copy-after"``: a copy does not wait for the compute that still reads the evicted slot (its ``after``): the
  poison lands under a running kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeflow.offload.transport import CudaHandle, CudaTransport, Handle

DROPS = ("compute-wait", "copy-after")
POISON = 0xFF


class RaceTransport(CudaTransport):
    """CudaTransport + poison + delay on the copy stream; ``drop`` names one wait to delete (None: keep all)."""

    name = "race"

    def __init__(self, device: torch.device, sleep_cycles: int = 1_000_000, drop: str | None = None) -> None:
        if drop is not None and drop not in DROPS:
            raise ValueError(f"drop={drop!r}: expected one of {DROPS} or None")
        super().__init__(device, time_stalls=False)
        self.sleep_cycles = sleep_cycles
        self.drop = drop
        self.copies = 0

    def copy_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[Handle] = ()) -> Handle:
        """The copy engine's one entry (``copy`` calls it too): every destination poisoned, one sleep, the copies."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if self.drop != "copy-after":
                for h in after:
                    if isinstance(h, CudaHandle) and h.current:
                        self.stream.wait_event(h.event)
            for dst, _ in pairs:
                dst.view(torch.uint8).fill_(POISON)
            torch.cuda._sleep(self.sleep_cycles)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            handle = self.copy_events.record(self.stream)
        self.copies += len(pairs)
        return handle

    def wait_compute(self, handles: Sequence[Handle]) -> float:
        if self.drop == "compute-wait":
            return 0.0
        return super().wait_compute(handles)
