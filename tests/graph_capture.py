"""The CPU stand-in for a CUDA graph capture (tests/test_compile_cuda_graphs.py's module docstring says how it
works): :class:`TraceCapture` records a piece's aten ops and Triton launches and replays them on the same tensors;
a host read or host data copied in while capturing raises :class:`HostSyncError`. The tests use it, and the GPU
lane's benchmarks at their CPU sizes (``benchmarks.gpu.engine.cpu_capture_factory``)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class HostSyncError(AssertionError):
    pass


aten = torch.ops.aten
# ops a CUDA graph cannot hold: they read device values back to the host, or copy host data in
REFUSED = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten._unique2.default,
           aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
           aten.masked_select.default, aten.lift_fresh.default, aten.lift_fresh_copy.default,
           aten.repeat_interleave.Tensor}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.paused = 0  # inside a recorded op or Triton launch: what it runs is not recorded again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        if func in REFUSED:
            raise HostSyncError(f"{func} while capturing: a CUDA graph cannot hold it")
        self.paused += 1  # a launch inside an op (a custom op's kernel) is the op's: replayed with it
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.paused -= 1
        self.ops.append((func, args, kwargs or {}, out))
        return out


class _Launch:
    """A Triton launch held by a piece (under TRITON_INTERPRET, the interpreter's entry point
    ``InterpretedFunction.run``): replayed by launching the kernel again on the same arguments, as a graph's kernel
    node does."""

    def __init__(self, run, fn) -> None:
        self.run, self.fn = run, fn

    def __call__(self, *args, **kwargs) -> None:
        self.run(self.fn, *args, **kwargs)


@contextlib.contextmanager
def _recording_launches(mode: _Recorder):
    """Record each Triton launch in ``mode`` as one op (its interpreted body not recorded)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no Triton: nothing to record
        yield
        return
    run = InterpretedFunction.run

    def launch(fn, *args, **kwargs):
        if mode.paused:
            return run(fn, *args, **kwargs)
        mode.paused += 1
        try:
            out = run(fn, *args, **kwargs)
        finally:
            mode.paused -= 1
        mode.ops.append((_Launch(run, fn), args, dict(kwargs), None))
        return out

    InterpretedFunction.run = launch
    try:
        yield
    finally:
        InterpretedFunction.run = run


def _replay(ops: list[tuple]) -> None:
    for func, args, kwargs, captured in ops:
        if isinstance(func, _Launch):
            func(*args, **kwargs)
            continue
        fresh = func(*args, **kwargs)
        for old, new in zip(tree_flatten(captured)[0], tree_flatten(fresh)[0], strict=True):
            if not isinstance(old, torch.Tensor):
                assert old == new, f"{func}: a non-tensor output changed on replay ({old} -> {new})"
                continue
            assert old.shape == new.shape, f"{func}: shape {tuple(old.shape)} at capture, {tuple(new.shape)} now"
            if new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
                old.copy_(new)  # a fresh output: into the buffer later ops of the capture read


class TraceCapture:
    """A :class:`moeflow.engine.cuda_graphs.GraphCapture` on the CPU (see the module docstring)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.pieces: list[list[tuple]] = []
        self._mode: _Recorder | None = None
        self._launches: contextlib.ExitStack | None = None

    def begin(self) -> None:
        self._mode = _Recorder()
        self._launches = contextlib.ExitStack()
        self._launches.enter_context(_recording_launches(self._mode))
        self._mode.__enter__()

    def end(self):
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self._launches.close()
        self.pieces.append(mode.ops)
        return lambda: _replay(mode.ops)

    def abort(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._launches.close()

    def side_stream(self):
        return contextlib.nullcontext()
