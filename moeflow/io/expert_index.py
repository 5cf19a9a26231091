"""Where each expert's bytes lie in a checkpoint's safetensors files, and reading one expert with a few preads.

Built once at load from the shards' headers (8-byte length + JSON: dtype, shape, data offsets), never from the
tensor data: :class:`ExpertIndex` runs the family's ``read_expert`` against a recording reader that hands out
meta tensors, so it learns which tensors (or which rows of a stacked ``[E, ...]`` tensor) make up each expert,
in any tensor order and across shards. A read then merges those byte ranges (ranges closer than ``max_gap``
become one read), preads them into a small staging buffer, and runs ``read_expert`` again on views of that
buffer: the family's own code turns them into the slot layout's tensors. Nothing maps or reads a whole file.

A shard truncated or deleted after load fails the read with :class:`~moeflow.errors.CheckpointError` naming the
file, and the caller gets no tensors, so nothing is served from a half-read expert. Files stay open (one
descriptor per shard): a shard replaced by rename keeps serving the bytes the index was built from.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.errors import CheckpointError
from moeflow.io.checkpoint import CheckpointReader

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
STAGING_ALIGN = 64

# read(fd, buffer, offset) -> bytes read: os.preadv by default; tests pass slow or failing readers
RangeReader = Callable[[int, memoryview, int], int]
# read_expert(reader, moe_layer, expert) -> the expert's tensors named as its ExpertFormat wants
ReadExpert = Callable[[CheckpointReader, int, int], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorLocation:
    """One tensor of a shard: absolute byte range ``[start, end)`` of its data in ``path``."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        return (self.end - self.start) // self.shape[0] if self.shape and self.shape[0] else self.end - self.start


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` (axis 0) of a tensor: what one ``get``/``get_slice`` of ``read_expert`` asked for."""

    name: str
    lo: int
    hi: int


@dataclass(frozen=True)
class ExpertRead:
    """One expert's reads: ``(path, file offset, length, staging offset)`` and where each piece lands."""

    reads: tuple[tuple[Path, int, int, int], ...]
    pieces: dict  # Piece -> staging offset
    nbytes: int  # bytes read (pieces plus the small gaps merged between them)


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse one safetensors file's header (CheckpointError naming the file when it is not one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes (corrupt file?)")
            header = json.loads(f.read(n))
        size = os.path.getsize(path)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read the safetensors header of {path}: {e}") from e
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which moeflow cannot read")
        a, b = info["data_offsets"]
        if base + b > size:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} ends at byte {base + b}, the file has {size}")
        out[name] = TensorLocation(path, dtype, tuple(info["shape"]), base + a, base + b)
    return out


class _Locations(dict):
    """tensor name -> :class:`TensorLocation`, filled one shard header at a time when a name of that shard is first
    looked up: shards without expert tensors (an MTP-only shard, the embeddings) are never opened."""

    def __init__(self, weight_map: dict) -> None:
        super().__init__()
        self.weight_map = weight_map
        self.read: set[str] = set()

    def __missing__(self, name: str) -> TensorLocation:
        path = self.weight_map.get(name)
        if path is None or str(path) in self.read:
            raise KeyError(name)
        self.read.add(str(path))
        self.update(read_header(Path(path)))
        return self[name]


class _Handle:
    """What ``CheckpointReader._open`` returns (``get_tensor``, ``get_slice``), served from the index."""

    def __init__(self, reader: _IndexReader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get_tensor(self, name: str) -> torch.Tensor:
        loc = self.reader.locations[name]
        return self.reader.piece(Piece(name, 0, loc.shape[0] if loc.shape else 1), loc, whole=True)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.reader, name)


class _Slice:
    def __init__(self, reader: _IndexReader, name: str) -> None:
        self.reader, self.name, self.loc = reader, name, reader.locations[name]

    def get_shape(self) -> list[int]:
        return list(self.loc.shape)

    def __getitem__(self, index) -> torch.Tensor:
        rows = self.loc.shape[0]
        if isinstance(index, int):
            i = index + rows if index < 0 else index
            return self.reader.piece(Piece(self.name, i, i + 1), self.loc, whole=False)[0]
        if isinstance(index, slice) and index.step in (None, 1):
            lo, hi, _ = index.indices(rows)
            return self.reader.piece(Piece(self.name, lo, hi), self.loc, whole=False)
        raise NotImplementedError(f"expert index: slicing {self.name!r} with {index!r} (only rows of axis 0)")


class _IndexReader(CheckpointReader):
    """A CheckpointReader whose tensors come from the index: meta tensors while recording, staging views after."""

    def __init__(self, directory: Path, weight_map: dict, locations: dict[str, TensorLocation]) -> None:
        self.directory, self.weight_map, self.locations = directory, weight_map, locations
        self._handles = {}
        self.recorded: list[Piece] = []
        self.staging: torch.Tensor | None = None
        self.offsets: dict | None = None

    def _open(self, path: Path) -> _Handle:
        return _Handle(self, path)

    def piece(self, piece: Piece, loc: TensorLocation, whole: bool) -> torch.Tensor:
        shape = loc.shape if whole else (piece.hi - piece.lo, *loc.shape[1:])
        if self.staging is None:  # recording: no bytes, only the shape and the byte range
            self.recorded.append(piece)
            return torch.empty(shape, dtype=loc.dtype, device="meta")
        at = self.offsets[piece]
        n = (piece.hi - piece.lo) * loc.row_bytes if loc.shape else loc.end - loc.start
        raw = self.staging[at : at + n]
        if at % loc.dtype.itemsize:  # a tensor at an odd file offset: realign before reinterpreting
            raw = raw.clone()
        return raw.view(loc.dtype).view(shape)


class ExpertIndex:
    """Byte ranges of every (MoE layer, expert) of a checkpoint, and :meth:`read` of one expert through them.

    reader: the open checkpoint (its ``weight_map`` says which shard holds each tensor); read_expert: the
    family's reader bound to its layout and quantization; range_reader: ``(fd, buffer, offset) -> n``
    (default ``os.preadv``); max_gap: ranges of one file closer than this are read as one (the gap is read too).
    Thread-safe: reads of different experts may run at once, each into its caller's staging buffer.
    """

    def __init__(self, reader: CheckpointReader, read_expert: ReadExpert, num_layers: int, num_experts: int, *,
                 range_reader: RangeReader | None = None, max_gap: int = 64 * 2**10) -> None:
        self.directory = reader.directory
        self.num_layers, self.num_experts = num_layers, num_experts
        self.read_expert = read_expert
        self.range_reader = range_reader or _preadv
        self.locations = _Locations(reader.weight_map)  # headers read as the experts' shards are first named
        self._weight_map = dict(reader.weight_map)
        self.experts: dict[tuple[int, int], ExpertRead] = {}
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        for layer in range(num_layers):
            for expert in range(num_experts):
                self.experts[(layer, expert)] = self._plan(layer, expert, max_gap)
        self.staging_nbytes = max(e.reads[-1][3] + e.reads[-1][2] for e in self.experts.values()) + STAGING_ALIGN
        self.expert_bytes = sum(e.nbytes for e in self.experts.values())  # what reading every expert once reads
        self._fds: dict[Path, int] = {}
        self._fd_lock = threading.Lock()
        self._arenas: dict[int, _Arena] = {}  # id(staging buffer) -> its arena, dropped with the buffer
        self.bytes_read = 0
        self.reads = 0
        self._count_lock = threading.Lock()

    def _plan(self, layer: int, expert: int, max_gap: int) -> ExpertRead:
        rec = _IndexReader(self.directory, self._weight_map, self.locations)
        tensors = self.read_expert(rec, layer, expert)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise CheckpointError(f"expert ({layer}, {expert}) in {self.directory} has tensors {shapes}, "
                                  f"expert (0, 0) has {self.shapes}")
        spans = sorted({(self.locations[p.name], p) for p in rec.recorded},
                       key=lambda lp: (str(lp[0].path), lp[0].start + lp[1].lo * lp[0].row_bytes))
        reads: list[list] = []  # [path, file offset, length, staging offset]
        pieces, staged = {}, 0
        for loc, piece in spans:
            a = loc.start + piece.lo * loc.row_bytes
            b = loc.start + piece.hi * loc.row_bytes if loc.shape else loc.end
            last = reads[-1] if reads else None
            if last is not None and last[0] == loc.path and a - (last[1] + last[2]) <= max_gap \
                    and a >= last[1]:
                last[2] = max(last[2], b - last[1])
            else:
                staged = _align(reads[-1][3] + reads[-1][2]) if reads else 0
                last = [loc.path, a, b - a, staged]
                reads.append(last)
            pieces[piece] = last[3] + (a - last[1])
        return ExpertRead(tuple(tuple(r) for r in reads), pieces, sum(r[2] for r in reads))

    def nbytes(self, layer: int, expert: int) -> int:
        """Bytes one read of the expert takes from disk."""
        return self.experts[(layer, expert)].nbytes

    def new_staging(self) -> torch.Tensor:
        """``uint8 [staging_nbytes]``: one reader thread's buffer (reused for every read)."""
        return torch.empty(self.staging_nbytes, dtype=torch.uint8)

    def read(self, layer: int, expert: int, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's tensors (named and shaped as ``read_expert`` gives them), read into ``staging``.

        The tensors may be views of ``staging``, or of its arena (tensors the family joins, e.g. w13 from gate
        and up: :func:`joined_empty`): convert them (``ExpertFormat.write``) before the next read into the same
        buffer. CheckpointError when a shard is gone or shorter than the index says.
        """
        plan = self.experts.get((layer, expert))
        if plan is None:
            raise IndexError(f"expert ({layer}, {expert}) outside the index ({self.num_layers} x {self.num_experts})")
        view = memoryview(staging.numpy())
        total = 0
        for path, offset, length, at in plan.reads:
            read_range(self._fd(path), view[at : at + length], offset, path, (layer, expert), self.range_reader)
            total += length
        with self._count_lock:
            self.bytes_read += total
            self.reads += 1
        rec = _IndexReader(self.directory, self._weight_map, self.locations)
        rec.staging, rec.offsets = staging, plan.pieces
        arena = self._arena_of(staging)
        arena.used = 0
        token = _ARENA.set(arena)
        try:
            return self.read_expert(rec, layer, expert)
        finally:
            _ARENA.reset(token)

    def _arena_of(self, staging: torch.Tensor) -> _Arena:
        """The arena of ``staging`` (made on its first read, freed with it)."""
        key = id(staging)
        with self._fd_lock:
            arena = self._arenas.get(key)
            if arena is None:
                arena = self._arenas[key] = _Arena(self.staging_nbytes)
                weakref.finalize(staging, self._arenas.pop, key, None)
        return arena

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as e:
                        raise CheckpointError(f"checkpoint shard {path} cannot be opened any more: {e}") from e
                    self._fds[path] = fd
        if os.fstat(fd).st_nlink == 0:  # deleted after load: an error now rather than bytes of a ghost file
            raise CheckpointError(f"checkpoint shard {path} was deleted after the model was loaded")
        return fd

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _Arena:
    """Where the tensors one read joins from its pieces go (:func:`joined_empty`): one buffer per staging buffer,
    reused by every read into it, instead of a fresh allocation per expert (a Mixtral w13 ``qweight`` is 58 MB:
    its first-touch page faults cost as much as the conversion after it). Sized as the staging buffer: what a
    read joins is made of its pieces; a tensor that does not fit gets its own allocation."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        n = dtype.itemsize
        for d in shape:
            n *= d
        at = _align(self.used)
        if at + n > self.buffer.numel():
            return None
        self.used = at + n
        return self.buffer[at : at + n].view(dtype).view(shape)


_ARENA: ContextVar[_Arena | None] = ContextVar("moeflow_expert_read_arena", default=None)


def joined_empty(like: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` and ``like``'s dtype and device, for a family's reader to join an
    expert's pieces into: inside :meth:`ExpertIndex.read`, a view of the reading buffer's arena (valid until the
    next read into that buffer, as the staging views are); elsewhere ``like.new_empty(shape)``."""
    arena = _ARENA.get()
    if arena is not None and like.device.type == "cpu":
        out = arena.take(tuple(shape), like.dtype)
        if out is not None:
            return out
    return like.new_empty(shape)


def _preadv(fd: int, buffer: memoryview, offset: int) -> int:
    return os.preadv(fd, [buffer], offset)


def read_range(fd: int, dest: memoryview, offset: int, path: Path, expert: tuple[int, int],
               read: RangeReader = _preadv) -> None:
    """Fill ``dest`` with the file's bytes from ``offset`` (a read may return fewer bytes than asked: loop), for
    ``expert`` (layer, expert); CheckpointError naming the file when it fails or ends early."""
    got, length = 0, len(dest)
    while got < length:
        try:
            n = read(fd, dest[got:], offset + got)
        except OSError as e:
            raise CheckpointError(f"reading expert {expert} from {path}: {e}") from e
        if n <= 0:
            raise CheckpointError(
                f"{path} is shorter than when it was loaded: expert {expert} needs bytes "
                f"[{offset}, {offset + length}) but the file has {_size_of(fd)} (truncated after load?)")
        got += n




def _align(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


def _size_of(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return -1
