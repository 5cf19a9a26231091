"""``@host_logic``: the methods ``torch.compile`` must not trace (host-side scheduling that reads the routing back:
under torch.compile, the layer's one graph break), without importing ``torch._dynamo`` when moeflow is imported.

``torch.compiler.disable`` imports ``torch._dynamo`` (and sympy) at decoration time: ~1.8 s of a cold start on a
quiet machine (docs/disk.md, cold TTFT), paid by every run although only ``compile=True`` needs it. A method
decorated here stays the plain function until :func:`arm` (called by ``moeflow.engine.compiled`` before it compiles
anything) replaces every one with its ``torch.compiler.disable`` form, so a compiled decode breaks at exactly the
same places as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_armed = False
_methods: list[tuple[type, str, Callable[..., Any]]] = []  # (class, attribute, the undecorated function)


class host_logic:  # noqa: N801 (used as a decorator)
    """Method decorator: ``torch.compiler.disable`` once :func:`arm` has run (module docstring)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        _methods.append((owner, name, self.fn))
        setattr(owner, name, _disabled(self.fn) if _armed else self.fn)


def _disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    return torch.compiler.disable(fn)


def arm() -> None:
    """Make every ``@host_logic`` method a graph break from now on (idempotent): before ``torch.compile`` runs."""
    global _armed
    if _armed:
        return
    for owner, name, fn in _methods:
        setattr(owner, name, _disabled(fn))
    _armed = True


def eager_host_step(*tensors: Any) -> bool:
    """Whether a step may read ``tensors``' values on the host and hand back results kept from earlier steps (the
    CPU decode glue's shortcuts: the one-query mask, a position's rotary, numpy's argmax): plain CPU tensors (not
    a subclass: the tests' stand-in for device memory is one), not under ``torch.compile`` nor inside a
    ``TorchDispatchMode`` (a recording of the step's ops, as the tests' CPU stand-in for a CUDA graph capture,
    replays ops: a kept result or a host read would not replay)."""
    import torch
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    for t in tensors:
        if type(t) is not torch.Tensor or not t.is_cpu:
            return False
    return not is_in_torch_dispatch_mode() and not torch.compiler.is_compiling()
