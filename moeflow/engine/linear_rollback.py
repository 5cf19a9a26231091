"""Rolling the linear-attention states back past rejected drafts (MTP speculation on Qwen3-Next / Qwen3.5-MoE).

A Gated DeltaNet layer keeps one recurrent state and one conv state per sequence, not an entry per position: a
verify pass over ``1 + k`` tokens advances them over all of them, and a rejected draft would stay in them. The
states are copied before the verify pass; the pass records every DeltaNet layer's input (``[B, 1 + k, H]``, its
normed hidden state: what the layer read); when only ``kept`` tokens are kept the copies are put back and the
DeltaNet layers alone run again over their recorded inputs' first ``kept`` positions. Those inputs are the verify
pass's own (a causal model's position i does not depend on later tokens), so the states become exactly what the
pass computed after the kept tokens, without the attention, MoE and expert transfers of a second pass.

:class:`LinearInputRecorder` holds the forward pre-hooks (on the eager decoder's :class:`GatedDeltaNet` modules:
the passes it records must run the decoder eagerly, which MTP speculation does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeflow.families.gated_deltanet import GatedDeltaNet


class LinearInputRecorder:
    """Records the inputs of ``decoder``'s Gated DeltaNet layers during the passes run while ``active``, inside
    ``with recorder:`` (the hooks are registered on entry, removed on exit; the last inputs stay for a replay)."""

    def __init__(self, decoder: nn.Module) -> None:
        self.layers = [m for m in decoder.modules() if isinstance(m, GatedDeltaNet)]
        self.inputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self.active = False
        self._handles: list[Any] = []

    def __enter__(self) -> LinearInputRecorder:
        self.inputs = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:  # (the inputs recorded last stay for a replay)
            h.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self.active:
                self.inputs[i] = args[0]  # x [B, T, H]
        return hook

    def replay(self, cache: Any, kept: int) -> None:
        """Run every DeltaNet layer over the first ``kept`` positions of its recorded input, reading and writing its
        states through ``cache`` (a pass cache whose token mask covers those ``kept`` positions)."""
        for layer, x in zip(self.layers, self.inputs, strict=True):
            if x is None:
                raise RuntimeError("linear-attention rollback: no input recorded for a Gated DeltaNet layer")
            layer(x[:, :kept], cache)
