"""``custom_op``: ``torch.library.custom_op`` whose eager calls run the Python function directly.

The custom ops exist for ``torch.compile``: they make the kernels opaque, fake-tensor-traceable graph nodes. An
eager call through the op costs the dispatcher's round trip per call and, on the first call of any custom op in
the process, the import of ``torch._dynamo`` and sympy (the op's backend implementation runs inside
``torch._disable_dynamo``): ~1.8 s of a cold start on a quiet machine, paid by runs that never compile. Here the
op is registered as before (``torch.ops.moeflow.<name>`` exists, ``register_fake`` works), and a call outside
tracing runs the same function body itself; under ``torch.compile``, or while a ``TorchDispatchMode`` watches
(fake tensors, the CUDA-graph capture checks of ``tests/test_host_loop.py``: they see the op as one node, as a
compiled graph does), the call goes through the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


class EagerFirstOp:
    """A registered custom op (``.op``) and its function (``.fn``): eager calls run ``fn``, traced ones ``op``."""

    def __init__(self, op: Any, fn: Callable[..., Any]) -> None:
        self.op, self.fn = op, fn
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return self.op(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fake)


def custom_op(name: str, *, mutates_args: Iterable[str] | str) -> Callable[[Callable[..., Any]], EagerFirstOp]:
    """Decorator: register ``fn`` as the custom op ``name`` (``torch.library.custom_op``) and return an
    :class:`EagerFirstOp` of the two."""
    def wrap(fn: Callable[..., Any]) -> EagerFirstOp:
        return EagerFirstOp(torch.library.custom_op(name, mutates_args=mutates_args)(fn), fn)
    return wrap
