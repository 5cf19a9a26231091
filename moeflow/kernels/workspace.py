"""Persistent scratch buffers of the eager kernel path: no allocation per call on the hot path.

A buffer is keyed by (name, device, CUDA stream, dtype) and only grows; callers get a view of the size they
ask for. Only intermediates that never leave a call live here (plan, ``h``, split-K partials, per-pair outputs
of ``moe_forward``): results handed back to the caller are fresh tensors. Work on one stream is ordered, so
reusing a buffer across calls is safe; another stream gets its own buffer.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}


def _stream_key(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` on ``device`` backed by a reused buffer (contents undefined)."""
    key = (name, device, _stream_key(device), dtype)
    n = 1
    for d in shape:
        n *= d
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.empty((max(n, 1),), dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[:n].view(shape)


def clear() -> None:
    """Free every scratch buffer (e.g. after a model is unloaded)."""
    _BUFFERS.clear()
