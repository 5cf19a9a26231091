"""What the serving engine's parts ask of each other, as Protocols: :class:`ServedModel` (the loaded model,
``moeflow.api``'s, which the engine may not import) and :class:`DraftHost` (the
:class:`~moeflow.engine.continuous.ContinuousEngine` as its drafters use it; that module imports the drafters,
so they cannot import it)."""

from __future__ import annotations

from typing import Protocol

import torch

from moeflow.engine.cuda_graphs import CudaGraphDecode
from moeflow.engine.generate import Runner
from moeflow.engine.kv_slots import SlotKVCache
from moeflow.engine.sequence import Sequence
from moeflow.engine.token_history import TokenHistory
from moeflow.families.base import Family
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.offload.stats import Stats


class ServedModel(Protocol):
    """A loaded model (``MoEOffloadedMixtral.from_pretrained``): its family, its runner (decoder, expert backend,
    decode function), its counters, its device and dtype, and its multi-token-prediction layers (or None)."""

    family: Family
    stats: Stats
    mtp: MultiTokenPredictor | None
    device: torch.device
    dtype: torch.dtype

    @property
    def runner(self) -> Runner: ...


class DraftHost(Protocol):
    """The serving engine as a drafter (prompt lookup, MTP) drives it: its model, slotted cache, device, token
    history (None unless the backend reads it), captured decode (None when off), one forward pass, the pass
    counters, and a sequence's token recorded or finished."""

    model: ServedModel
    cache: SlotKVCache
    device: torch.device
    history: TokenHistory | None
    graphs: CudaGraphDecode | None

    def _pass(self, phase: str, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor: ...

    def _count(self, phase: str, batch: int, tokens: int, seconds: float) -> None: ...

    def _record(self, seq: Sequence, token: int, logits: torch.Tensor) -> str | None: ...

    def _finish(self, seq: Sequence, reason: str) -> None: ...
