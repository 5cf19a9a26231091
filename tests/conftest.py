"""Test-wide set-up. TRITON_INTERPRET must be set before any module defining @triton.jit kernels is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# test tensors are tiny: torch's intra-op threads only spin-wait (5x slower seen on a loaded 2-core machine)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


def _patch_device_calls_once_per_launch() -> None:
    """Triton's interpreter re-patches ``triton.language`` (``inspect.getmembers`` of tl, tl.core, tl.math, ...)
    on every call of a ``@triton.jit`` device function, though the launch already patched them: ~0.5 ms per
    call, 20-40 % of an interpreted expert GEMM (``_dequant_tile`` makes 9 calls per K tile). Skip a device
    call's patching when the running launch (this thread's) already patched the modules its globals name; the
    first call naming another module still patches it as before. The patches are the same objects either way,
    so the kernels compute the same; where the internals differ (another Triton), nothing is changed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None or getattr(patch_lang, "once", False):
        return
    state = threading.local()  # .langs: one entry per running launch, the ids of the modules patched in it

    named: dict = {}

    def langs(fn) -> frozenset[int]:
        if fn not in named:
            named[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return named[fn]

    def patch_once(fn):
        stack = getattr(state, "langs", None)
        if stack and stack[-1] is not None and langs(fn) <= stack[-1]:
            return scope_type()  # nothing to restore: the launch's own scope restores its patches
        scope = patch_lang(fn)
        if stack:
            stack[-1] = langs(fn) | (stack[-1] or frozenset())
        return scope

    patch_once.once = True
    run = executor.__call__

    def call(self, *args, **kwargs):
        if getattr(state, "langs", None) is None:
            state.langs = []
        state.langs.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            state.langs.pop()

    interpreter._patch_lang = patch_once
    executor.__call__ = call


_patch_device_calls_once_per_launch()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, restored after it (tests elsewhere may change the count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """The hybrid cost model's calibration cache in the test's own folder: never the user's cache."""
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
