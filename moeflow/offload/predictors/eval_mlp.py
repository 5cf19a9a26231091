"""Small eval-mode MLPs run as direct torch calls: :class:`EvalSequential` (the learned predictors' runtime call)."""

from __future__ import annotations

import torch
from torch import nn


class EvalSequential:
    """An eval-mode ``nn.Sequential`` of Linear / BatchNorm1d / ReLU / Dropout run as direct torch calls.

    Bitwise the module's own output (the same kernels, in the same order; Dropout is the identity in eval
    mode), without the per-module call overhead (hooks, ``__getattr__``, BatchNorm's argument logic: ~2-4 us a
    module on a small CPU, 26 modules in DuoServe's ExpertMLP), and under ``no_grad`` only when grad is on.
    The parameter tensors are gathered on first use; :meth:`reset` after moving the module (``.to`` replaces
    buffers). Any other module, or a module in training mode, runs through the module itself.
    """

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq
        self._steps: list[tuple] | None = None

    def reset(self) -> None:
        self._steps = None

    def _plan(self) -> list[tuple] | None:
        steps: list[tuple] = []
        for m in self.seq:
            if type(m) is nn.Linear:
                steps.append(("linear", m.weight, m.bias))
            elif type(m) is nn.BatchNorm1d and m.track_running_stats and m.running_mean is not None:
                steps.append(("bn", m.weight, m.bias, m.running_mean, m.running_var, m.eps))
            elif type(m) is nn.ReLU:
                steps.append(("relu",))
            elif type(m) is nn.Dropout:
                continue
            else:
                return None
        return steps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq.training:
            return self.seq(x)
        if self._steps is None:
            self._steps = self._plan() or []
        if not self._steps:
            with torch.no_grad():
                return self.seq(x)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._run(x)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        cudnn = torch.backends.cudnn.enabled
        for step in self._steps:
            kind = step[0]
            if kind == "linear":
                x = torch._C._nn.linear(x, step[1], step[2])
            elif kind == "bn":
                _, w, b, mean, var, eps = step
                x = torch.batch_norm(x, w, b, mean, var, False, 0.0, eps, cudnn)
            else:
                x = torch.relu(x)
        return x
