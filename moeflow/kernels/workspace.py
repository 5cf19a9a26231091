"""Persistent scratch buffers of the eager kernel path: no allocation per call on the hot path.

A buffer is keyed by (name, device, CUDA stream, dtype) and only grows; callers get a view of the size they
ask for. Only intermediates that never leave a call live here (plan, ``h``, split-K partials, per-pair outputs
of ``moe_forward``): results handed back to the caller are fresh tensors. Work on one stream is ordered, so
reusing a buffer across calls is safe; another stream gets its own buffer.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}  # (name, device, stream, dtype) -> flat buffer
_VIEWS: dict[tuple, torch.Tensor] = {}  # (buffer key, shape) -> its view
MAX_VIEWS = 512

try:  # the raw cudaStream_t of the device's current stream: the query Triton's launcher makes per launch
    from torch._C import _cuda_getCurrentRawStream as _raw_current_stream
except ImportError:  # a torch built without CUDA
    _raw_current_stream = None


def _stream_key(device: torch.device) -> int:
    """The stream work on ``device`` is issued to now (0 on the CPU).

    ``torch.cuda.current_stream(i).cuda_stream`` and ``torch._C._cuda_getCurrentRawStream(i)`` read the same
    thread-local current stream (the one ``torch.cuda.stream(...)`` sets), the first building a ``Stream``
    object around it (~18 us per call on the H100 host, ~12 calls per layer), the second returning its handle
    as an int; Triton's own driver treats them as interchangeable (``GPUDriver.get_current_stream``) and
    launches every kernel on the raw one, so this key is the stream the scratch's kernels run on."""
    if device.type != "cuda":
        return 0
    return current_stream_handle(device.index if device.index is not None else torch.cuda.current_device())


def current_stream_handle(index: int) -> int:
    """The raw ``cudaStream_t`` of CUDA device ``index``'s current stream (see :func:`_stream_key`: no ``Stream``
    object built)."""
    if _raw_current_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_current_stream(index)


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` on ``device`` backed by a reused buffer (contents undefined).

    The view of a (buffer, shape) is made once and handed out again (no slice / view ops per call at decode);
    the views are forgotten when their buffer grows, and all of them past ``MAX_VIEWS`` (prefill shapes vary)."""
    key = (name, device, _stream_key(device), dtype)
    view = _VIEWS.get((key, shape))
    if view is not None:
        return view
    n = 1
    for d in shape:
        n *= d
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.empty((max(n, 1),), dtype=dtype, device=device)
        _BUFFERS[key] = buf
        for stale in [v for v in _VIEWS if v[0] == key]:
            del _VIEWS[stale]
    if len(_VIEWS) >= MAX_VIEWS:
        _VIEWS.clear()
    view = buf[:n].view(shape)
    _VIEWS[(key, shape)] = view
    return view


SPLIT_K_PARTIALS = "split_k_partials"  # scratch name of the expert kernels' fp32 split-K partials
MIN_COUNTERS = 4096  # the first counter buffer's size: every decode grid fits, so none grows on the hot path


def counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters [>= n] of the split-K fixup (``triton_experts``), one buffer per (device,
    stream): every launch that uses them leaves them zero, so they are zeroed once, when the buffer is made or
    grows (never per call; a warm-up on the stream a CUDA graph is captured on makes them before the capture)."""
    key = ("split_k_counters", device, _stream_key(device), torch.int32)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros((max(n, MIN_COUNTERS),), dtype=torch.int32, device=device)
        _BUFFERS[key] = buf
    return buf


def clear() -> None:
    """Free every scratch buffer (e.g. after a model is unloaded)."""
    _VIEWS.clear()
    _BUFFERS.clear()
