"""Finding and opening GGUF files: one file, a directory holding one, or a split set (``-00001-of-00003.gguf``).

Reading is gguf-py's (``gguf.GGUFReader``: the header, metadata and tensor table; the data memory-mapped, never read
here). :class:`GGUFFiles` is every part of one model: the metadata (from the first part, which llama.cpp's
``gguf-split`` gives the whole of it) and each tensor's :class:`TensorInfo`, where its bytes lie. A truncated file,
a part missing from a split set or a file that is not GGUF is a :class:`~moeflow.errors.CheckpointError` naming
the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.errors import CheckpointError
from moeflow.quant.ggml import GGMLType, ggml_type

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
INSTALL_HINT = "reading GGUF files needs gguf-py: pip install 'moeflow[gguf]' (or gguf>=0.18,<0.20)"


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError(INSTALL_HINT) from e
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: bytes ``[offset, offset + nbytes)`` of ``path``, of ggml type ``type``.

    ``shape`` is outermost first (numpy / torch order, the reverse of GGUF's ``ne``): a weight is ``[out, in]``,
    llama.cpp's stacked experts ``[E, out, in]``; a row of the innermost dimension is a whole number of blocks."""

    name: str
    path: Path
    offset: int
    nbytes: int
    type: GGMLType
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the innermost dimension."""
        return self.type.row_bytes(self.shape[-1], f"{self.path}: tensor {self.name!r}")


def is_gguf_path(path: str | os.PathLike) -> bool:
    """A path naming a GGUF file (by its suffix)."""
    return str(path).lower().endswith(".gguf")


def find_gguf(directory: Path, gguf_file: str | None = None) -> Path | None:
    """The GGUF file in ``directory`` (``gguf_file``: that one; a split set counts as one file, its first part), or
    None when the directory has no ``.gguf`` at all. Several models in one directory without ``gguf_file`` is an
    error listing them."""
    if gguf_file is not None:
        path = directory / gguf_file
        if not path.is_file():
            raise CheckpointError(f"gguf_file={gguf_file!r}: no such file in {directory}")
        return path
    found = sorted(p for p in directory.glob("*.gguf") if not (m := SPLIT.match(p.name)) or int(m["no"]) == 1)
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(f"{directory} holds several GGUF models ({', '.join(p.name for p in found)}): "
                              "pass gguf_file= to choose one")
    return found[0]


def split_parts(path: Path) -> list[Path]:
    """Every part of the split set ``path`` belongs to, in order (``[path]`` when it is not split). A missing part
    is an error naming it."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: the split GGUF set has {count} parts but {', '.join(map(str, missing))} "
                              f"{'is' if len(missing) == 1 else 'are'} missing")
    return parts


def field_value(field: Any) -> Any:
    """A gguf-py ReaderField's value: str, int, float, bool, or a list of them."""
    return field.contents()


class GGUFFiles:
    """The parts of one GGUF model: ``metadata`` (key -> value, the first part's) and ``tensors`` (name ->
    :class:`TensorInfo`) over every part. ``path``: the file given (the first part of a split set)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        self.parts = split_parts(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        for i, part in enumerate(self.parts):
            reader = _open(part)
            if i == 0:
                self.metadata = {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            self._add_tensors(part, reader)
        if "general.architecture" not in self.metadata:
            raise CheckpointError(f"{self.path}: no general.architecture in the GGUF metadata")

    def _add_tensors(self, part: Path, reader: Any) -> None:
        size = part.stat().st_size
        for t in reader.tensors:
            what = f"{part}: tensor {t.name!r}"
            kind = ggml_type(int(t.tensor_type), what, getattr(t.tensor_type, "name", None))
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            nbytes = kind.row_bytes(shape[-1], what) * int(np.prod(shape[:-1], dtype=np.int64))
            if t.data_offset + nbytes > size:
                raise CheckpointError(f"{part} is truncated: tensor {t.name!r} ends at byte {t.data_offset + nbytes}, "
                                      f"the file has {size}")
            if t.name in self.tensors:
                raise CheckpointError(f"{part}: tensor {t.name!r} is also in {self.tensors[t.name].path}")
            self.tensors[t.name] = TensorInfo(t.name, part, int(t.data_offset), nbytes, kind, shape)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def read(self, info: TensorInfo, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` of the outermost dimension of ``info`` as bytes: uint8 [hi - lo, ..., row_bytes]
        (a 1-D tensor: its [row_bytes]); only those bytes are read."""
        rows = info.shape[0] if len(info.shape) > 1 else 1
        hi = rows if hi is None else hi
        per = info.nbytes // rows
        data = bytearray((hi - lo) * per)
        with open(info.path, "rb") as f:
            f.seek(info.offset + lo * per)
            got = f.readinto(data)
        if got != len(data):
            raise CheckpointError(f"{info.path} is shorter than when it was opened: tensor {info.name!r} "
                                  f"(truncated after load?)")
        out = np.frombuffer(data, dtype=np.uint8)
        if len(info.shape) == 1:
            return out.reshape(info.row_bytes)
        return out.reshape(hi - lo, *info.shape[1:-1], info.row_bytes)


@lru_cache(maxsize=1)
def _reader_class() -> type:
    """gguf-py's ``GGUFReader`` with its one slicing primitive (``_get``) taking plain ndarray views of the mapped
    file: the same arrays and fields, without ``np.memmap``'s Python-level ``__getitem__`` / ``__array_finalize__``
    on each of the ~3 slices per vocabulary token that parsing the metadata makes (most of the time to open a
    file: 2-5 s for a 32k vocabulary on this machine, several times that for 150k). ``_get`` is the same in gguf
    0.18 and 0.19 (bounded in pyproject.toml); the GGUF tests read every field through it."""
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain_data")
            if plain is None or plain.base is not self.data.base:
                plain = self._plain_data = self.data.view(np.ndarray)  # the same mapping, not a memmap subclass
            count = int(count)
            dtype = np.dtype(dtype)
            arr = plain[offset: offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            """gguf-py's, with an array of scalars or strings (a vocabulary's tokens, scores and types: 3 x 32k+
            elements) walked in one loop of views instead of a recursive call and one or two ``_get`` per element:
            the same parts (each element's own 1-element array, a string's length and bytes), data indices and
            types (tests/test_gguf_load_fast.py compares them field by field with gguf-py's reader)."""
            vt = gguf.GGUFValueType
            if raw_type != vt.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(vt(itype)) if itype != vt.STRING else None
            if n == 0 or (itype != vt.STRING and nptype is None):  # (nested arrays: gguf-py's recursion)
                return super()._get_field_parts(orig_offs, raw_type)
            parts: list = [raw_itype, alen]
            if nptype is not None:
                whole = self._get(offs, nptype, n)
                if len(whole) != n:
                    raise ValueError(f"array at {orig_offs} runs past the end of the file")
                parts += [whole[i: i + 1] for i in range(n)]
                return 12 + int(whole.nbytes), parts, list(range(2, 2 + n)), [vt.ARRAY, vt(itype)]
            plain = self._plain_data  # (set by the _get above)
            buf, u64 = memoryview(plain), np.dtype(np.uint64).newbyteorder(self.byte_order)
            little = u64.byteorder in "<=" if np.little_endian else u64.byteorder == "<"
            for _ in range(n):
                slen = int.from_bytes(buf[offs: offs + 8], "little" if little else "big")
                parts += [plain[offs: offs + 8].view(u64), plain[offs + 8: offs + 8 + slen]]
                offs += 8 + slen
            if offs > len(plain):
                raise ValueError(f"string array at {orig_offs} runs past the end of the file")
            return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [vt.ARRAY, vt.STRING]

    return Reader


def _open(path: Path) -> Any:
    try:
        return _reader_class()(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:  # what gguf-py raises on a bad file
        size = path.stat().st_size if path.exists() else -1
        raise CheckpointError(f"cannot read GGUF file {path} ({size} bytes; truncated or not a GGUF file?): "
                              f"{type(e).__name__}: {e}") from e
