"""Each expert of a GGUF model as the bytes the file stores: the source the expert formats, the disk tier and the
copy engine read.

llama.cpp stacks a layer's experts per projection (``blk.L.ffn_{gate,up,down}_exps.weight``, ``[E, out, in]``
outermost first), so one expert's matrix is one contiguous byte range of its stacked tensor:
:class:`ExpertSlice` (file, offset, bytes, ggml type, shape) and :class:`ExpertBytes` (its gate, up and down).

:class:`GGUFExpertSource` is an expert source as the engine's loader and the disk tier use one (the same methods
as :class:`~moeflow.io.expert_index.ExpertIndex`: ``read``, ``nbytes``, ``new_staging``, ...): a read preads the
expert's three ranges into a staging buffer and hands their raw bytes to a ``convert`` function, which makes the
tensors the expert format writes. :func:`dense_expert_tensors` (dequantize to ``w13`` / ``w2``) is the converter
of the interim dense format; a native GGUF format passes its own (the bytes as stored).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.errors import CheckpointError
from moeflow.io.expert_index import read_range
from moeflow.io.gguf.files import GGUFFiles
from moeflow.quant.awq import pack_int4
from moeflow.quant.ggml import GGMLType, dequantize, q4_0_codes

PROJECTIONS = ("gate", "up", "down")
STAGING_ALIGN = 64
AWQ_ZERO_8 = 0x88888888 - 2**32  # zero point 8 in all 8 nibbles of an int32


@dataclass(frozen=True)
class ExpertSlice:
    """One matrix of one expert as stored: bytes ``[offset, offset + nbytes)`` of ``path``, ``shape`` ``[out, in]``
    values of ggml type ``type`` (each of the ``out`` rows is ``in / type.block_size`` blocks). ``tensor``: the
    stacked GGUF tensor it is a row of."""

    path: Path
    offset: int
    nbytes: int
    type: GGMLType
    shape: tuple[int, int]
    tensor: str


@dataclass(frozen=True)
class ExpertBytes:
    """An expert's three matrices as stored (gate and up ``[I, H]``, down ``[H, I]``); ``block``, ``expert``: its
    decoder layer (``blk.N``) and index there (-1: not said)."""

    gate: ExpertSlice
    up: ExpertSlice
    down: ExpertSlice
    block: int = -1
    expert: int = -1

    @property
    def slices(self) -> dict[str, ExpertSlice]:
        return {"gate": self.gate, "up": self.up, "down": self.down}

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


# convert(expert, raw) -> the tensors an expert format writes; raw: "gate"/"up"/"down" -> uint8 [out, row_bytes]
ExpertConvert = Callable[[ExpertBytes, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def dense_expert_tensors(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dense format's tensors, fp32 and exact: ``w13`` [2I, H] (gate rows, then up) and ``w2`` [H, I]."""
    deq = {p: dequantize(raw[p], s.type.id, f"{s.path}: {s.tensor}") for p, s in expert.slices.items()}
    return {"w13": torch.cat([deq["gate"], deq["up"]], dim=0), "w2": deq["down"]}


def q4_0_awq_expert_tensors_reference(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`moeflow.engine.gguf_experts.q4_0_awq_expert_tensors` by unpacking every 4-bit code to a byte and
    packing them again (the reference the word-moving conversion is tested against)."""
    out = {}
    for name, parts in (("w13", ("gate", "up")), ("w2", ("down",))):
        check_q4_0(expert, parts)
        codes, d = zip(*(q4_0_codes(raw[p]) for p in parts), strict=True)
        codes, d = torch.cat(codes, dim=0), torch.cat(d, dim=0)  # [N, K], [N, K/32]
        out[f"{name}_qweight"] = pack_int4(codes.T.contiguous())
        out[f"{name}_qzeros"] = pack_int4(torch.full((d.shape[1], d.shape[0]), 8, dtype=torch.uint8))
        out[f"{name}_scales"] = d.T.contiguous()
    return out


def check_q4_0(expert: ExpertBytes, parts: tuple[str, ...]) -> None:
    """ValueError naming the file and tensor unless ``parts`` of ``expert`` are Q4_0 rows of whole AWQ words."""
    for p in parts:
        s = expert.slices[p]
        if s.type.name != "Q4_0":
            raise ValueError(f"{s.path}: {s.tensor}: {s.type.name}, not Q4_0")
        if s.shape[0] % 8 or s.shape[1] % 32:
            raise ValueError(f"{s.path}: {s.tensor}: expert rows [{s.shape[0]}, {s.shape[1]}] are not whole AWQ "
                             "words (rows % 8) and Q4_0 blocks (columns % 32)")


def expert_slices(files: GGUFFiles, block: int, expert: int, hidden: int, intermediate: int) -> ExpertBytes:
    """Where expert ``expert`` of decoder layer ``block`` lies (CheckpointError naming the file when a stacked tensor
    is missing or not ``[E, out, in]`` of the sizes the config implies)."""
    out = {}
    for proj, shape in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                        ("down", (hidden, intermediate))):
        name = f"blk.{block}.ffn_{proj}_exps.weight"
        info = files.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{files.path}: no tensor {name!r} (the experts of layer {block})")
        if len(info.shape) != 3 or info.shape[1:] != shape or not 0 <= expert < info.shape[0]:
            raise CheckpointError(f"{info.path}: tensor {name!r} has shape {info.shape}, but the metadata implies "
                                  f"[experts, {shape[0]}, {shape[1]}] (expert {expert} asked)")
        per = info.nbytes // info.shape[0]
        out[proj] = ExpertSlice(info.path, info.offset + expert * per, per, info.type, shape, name)
    return ExpertBytes(**out, block=block, expert=expert)


class GGUFExpertSource:
    """Every (MoE layer, expert) of a GGUF model, read as stored and converted by ``convert``.

    files: the model's files; blocks: the decoder layer (GGUF ``blk.N``) of each MoE layer, in MoE order;
    hidden / intermediate: the expert sizes the config implies (checked against every stacked tensor).
    Thread-safe: reads of different experts may run at once, each into its caller's staging buffer."""

    def __init__(self, files: GGUFFiles, blocks: tuple[int, ...], num_experts: int, hidden: int, intermediate: int,
                 convert: ExpertConvert = dense_expert_tensors) -> None:
        self.files, self.blocks, self.convert = files, blocks, convert
        self.directory = files.path.parent
        self.num_layers, self.num_experts = len(blocks), num_experts
        self.experts = {(layer, e): expert_slices(files, block, e, hidden, intermediate)
                        for layer, block in enumerate(blocks) for e in range(num_experts)}
        self.staging_nbytes = max(_staged(x)[1] for x in self.experts.values()) + STAGING_ALIGN
        self.expert_bytes = sum(x.nbytes for x in self.experts.values())
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0

    def expert(self, layer: int, expert: int) -> ExpertBytes:
        """Where the expert's matrices lie in the files (what a disk tier or copy engine moves as stored)."""
        found = self.experts.get((layer, expert))
        if found is None:
            raise IndexError(f"expert ({layer}, {expert}) outside the GGUF model "
                             f"({self.num_layers} MoE layers x {self.num_experts} experts)")
        return found

    def types(self) -> dict[str, set[str]]:
        """The ggml types the experts' gate / up / down matrices are stored in (a Q4_K_M file mixes Q4_K and
        Q6_K between layers)."""
        out: dict[str, set[str]] = {p: set() for p in PROJECTIONS}
        for x in self.experts.values():
            for p, s in x.slices.items():
                out[p].add(s.type.name)
        return out

    def nbytes(self, layer: int, expert: int) -> int:
        return self.expert(layer, expert).nbytes

    def new_staging(self) -> torch.Tensor:
        """``uint8 [staging_nbytes]``: one reader thread's buffer (reused for every read)."""
        return torch.empty(self.staging_nbytes, dtype=torch.uint8)

    def read_raw(self, layer: int, expert: int, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's bytes as stored: "gate" / "up" / "down" -> uint8 [out, row_bytes], views of ``staging``."""
        x = self.expert(layer, expert)
        at, _ = _staged(x)
        view = memoryview(staging.numpy())
        out = {}
        for p, s in x.slices.items():
            read_range(self._fd(s.path), view[at[p]: at[p] + s.nbytes], s.offset, s.path, (layer, expert))
            out[p] = staging[at[p]: at[p] + s.nbytes].view(s.shape[0], -1)
        with self._lock:
            self.bytes_read += x.nbytes
            self.reads += 1
        return out

    def read(self, layer: int, expert: int, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's tensors as ``convert`` makes them from its bytes (read into ``staging``)."""
        return self.convert(self.expert(layer, expert), self.read_raw(layer, expert, staging))

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"GGUF file {path} cannot be opened any more: {e}") from e
                self._fds[path] = fd
        if os.fstat(fd).st_nlink == 0:
            raise CheckpointError(f"GGUF file {path} was deleted after the model was loaded")
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _staged(x: ExpertBytes) -> tuple[dict[str, int], int]:
    """Staging offsets of the expert's matrices (each aligned), and the end of the last."""
    at, end = {}, 0
    for p, s in x.slices.items():
        at[p] = end
        end = -(-(end + s.nbytes) // STAGING_ALIGN) * STAGING_ALIGN
    return at, end
