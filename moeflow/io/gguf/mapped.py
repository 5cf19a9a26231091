"""A GGUF model's files mapped copy-on-write, its tensors' bytes as torch views of the mapping (issue 37).

llama.cpp's default load maps the file and computes on the mapped blocks: loading reads nothing, and a page comes
in from the page cache when a kernel first touches it. :class:`MappedGGUF` gives moeflow the same for the tensors
whose CPU form is the file's own bytes (GGUF Q8_0 / K-quant experts: :mod:`moeflow.kernels.cpu.gguf` computes the
blocks as stored): each file is mapped once, copy-on-write (``mmap.ACCESS_COPY``: ``MAP_PRIVATE`` with read and
write access on POSIX), so torch gets a writable buffer without a copy (a write, which moeflow never makes, would
copy that page and leave the file alone), and a view is ``torch.frombuffer`` over it. Every view holds a
reference to its mapping (``frombuffer`` keeps the buffer alive), and :class:`MappedGGUF` keeps every mapping it
made, so a mapping outlives its views.

A file shorter than its tensor table says is found when the range is mapped: a
:class:`~moeflow.errors.CheckpointError` naming the file and the tensor, not a ``SIGBUS`` at the first touch. (A
file truncated *after* it was mapped is outside what a mapping can check; llama.cpp has the same limit.)
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from moeflow.errors import CheckpointError


class MappedGGUF:
    """Copy-on-write maps of files (GGUF files; the CPU form cache's), made on first use and kept (module doc).
    Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            found = self._maps.get(path)
            if found is not None:
                return found
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path} cannot be opened any more: {e}") from e
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    raise CheckpointError(f"{path} is empty")
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, read + write (copy-on-write)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path} cannot be mapped: {e}") from e
            finally:
                os.close(fd)  # the mapping keeps the file
            self._maps[path] = mapped
            return mapped

    def view(self, path: Path, offset: int, nbytes: int, what: str) -> torch.Tensor:
        """uint8 [nbytes]: bytes ``[offset, offset + nbytes)`` of ``path``, a view of its mapping (no copy, nothing
        read until touched). ``what``: the tensor, named in the error when the file is shorter than that."""
        mapped = self._map(path)
        if offset < 0 or offset + nbytes > len(mapped):
            raise CheckpointError(f"{path} is truncated: {what} ends at byte {offset + nbytes}, the file has "
                                  f"{len(mapped)}")
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)

    def release(self, path: Path, offset: int, nbytes: int) -> None:
        """Drop this process's page-table entries for bytes ``[offset, offset + nbytes)`` of ``path``'s mapping
        (``MADV_DONTNEED``, whole pages inside the range): for bytes read once and copied elsewhere (an all-Q4_0
        file's experts, converted at load), so they stop counting in the process's resident set. The pages stay
        in the page cache, and a later touch maps them again (nothing was ever written to them)."""
        mapped = self._maps.get(path)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = min(offset + nbytes, len(mapped)) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in one of these mappings."""
        import ctypes

        p = t.data_ptr()
        for m in list(self._maps.values()):
            base = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if base <= p < base + len(m):
                return True
        return False

    @property
    def nbytes(self) -> int:
        """Bytes mapped (address space, not memory: pages come from the page cache when touched)."""
        return sum(len(m) for m in list(self._maps.values()))
