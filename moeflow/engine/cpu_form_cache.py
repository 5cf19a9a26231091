"""The CPU int4 form of a checkpoint's experts, converted once and mapped on later loads (issue 37's cold start).

Resident experts on ``device="cpu"`` (:class:`~moeflow.moe.resident.CpuInt4Experts`: AWQ safetensors checkpoints,
GGUF Q4_0 files) are converted at load into moeflow's q4 form (:class:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix`:
8-row tiles, scales apart), whose bytes are not the checkpoint's. With ``from_pretrained(cpu_form_cache=True)``
the first load writes every expert's form to one safetensors file under ``moeflow.user_cache.cache_dir() /
"cpu_forms"`` (written to a temporary name, then renamed: a reader never sees half a file), and later loads map
it copy-on-write and use the tensors as views (:class:`~moeflow.io.gguf.mapped.MappedGGUF`'s way): no read, no
conversion, pages faulted in from the page cache when first used.

The file is named by a key over the checkpoint files' names, sizes and modification times, the experts' shapes
and group size, :data:`FORM_VERSION` and the C kernels' source digest: a changed shard, a moved file or a new
kernel revision misses and converts again (the old file stays until the cache folder is cleared). A cache file
that cannot be used (cut short, another key inside) is warned about and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from moeflow.errors import CheckpointError
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.native import source_digest
from moeflow.kernels.cpu.q4_matrix import Q4Matrix
from moeflow.moe.resident import CpuInt4Experts
from moeflow.user_cache import cache_dir

FORM_VERSION = 1  # bump when Q4Matrix's layout changes without a change to the C sources
PARTS = ("packed", "scales", "mins")
DTYPES = {"U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}


def form_key(files: list[Path], num_layers: int, num_experts: int, hidden: int, intermediate: int,
             group_size: int) -> str:
    """The cache key of a checkpoint's CPU int4 forms (module doc)."""
    h = hashlib.sha256(f"moeflow cpu_form v{FORM_VERSION} {source_digest()} {num_layers}x{num_experts} "
                       f"{hidden} {intermediate} g{group_size}".encode())
    for f in sorted({Path(p).resolve() for p in files}):
        st = f.stat()
        h.update(f"\0{f}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def form_path(key: str) -> Path:
    return cache_dir() / "cpu_forms" / f"{key}.safetensors"


def save_forms(backend: CpuInt4Experts, key: str) -> Path | None:
    """Write every expert's q4 form to the cache file of ``key`` (atomically); None (nothing written) when an
    expert is not in moeflow's q4 form (torch's int4 fallback) or the folder cannot be written (warned)."""
    from safetensors.torch import save_file

    tensors = {}
    for layer, row in enumerate(backend.experts):
        for e, x in enumerate(row):
            if x is None or not x.native:
                return None
            for name, m in (("w13", x.w13), ("w2", x.w2)):
                for part in PARTS:
                    tensors[f"{layer}.{e}.{name}.{part}"] = getattr(m, part).contiguous()
    path = form_path(key)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"moeflow_cpu_form": key, "group_size": str(backend.fmt.group_size)})
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"moeflow: could not write the CPU expert form cache {path}: {e}", RuntimeWarning, stacklevel=2)
        return None
    return path


def load_forms(backend: CpuInt4Experts, key: str, intermediate: int) -> bool:
    """Fill ``backend.experts`` with views of the cache file of ``key``; False when there is none, or it cannot be
    used (warned: it is rewritten after this load converts). The mapping is kept on the backend
    (``backend.form_mapping``) and by every view."""
    path = form_path(key)
    if not path.is_file():
        return False
    mapping = MappedGGUF()
    try:
        head = mapping.view(path, 0, 8, "the header length")
        (n,) = struct.unpack("<Q", bytes(head.numpy()))
        header = json.loads(bytes(mapping.view(path, 8, n, "the header").numpy()))
        if header.get("__metadata__", {}).get("moeflow_cpu_form") != key:
            raise CheckpointError(f"{path}: another key inside")
        group = int(header["__metadata__"]["group_size"])

        def tensor(name: str) -> torch.Tensor:
            spec = header[name]
            lo, hi = spec["data_offsets"]
            if hi == lo:  # (an empty tensor: Q4_F16Z8's mins)
                return torch.empty(spec["shape"], dtype=DTYPES[spec["dtype"]])
            raw = mapping.view(path, 8 + n + lo, hi - lo, f"tensor {name!r}")
            return raw.view(DTYPES[spec["dtype"]]).view(spec["shape"])

        forms = [[Int4Expert(*(Q4Matrix(*(tensor(f"{layer}.{e}.{m}.{p}") for p in PARTS), group)
                               for m in ("w13", "w2")), intermediate)
                  for e in range(len(row))] for layer, row in enumerate(backend.experts)]
    except (CheckpointError, KeyError, ValueError, RuntimeError, struct.error) as e:
        warnings.warn(f"moeflow: the CPU expert form cache {path} cannot be used ({type(e).__name__}: {e}); "
                      "converting again", RuntimeWarning, stacklevel=2)
        return False
    backend.experts = forms
    backend.form_mapping = mapping
    return True


def cached_load(backend: CpuInt4Experts, files: list[Path], hidden: int, intermediate: int,
                convert: Callable[[], None]) -> bool:
    """The experts of ``backend`` from the cache file of the checkpoint ``files`` when it has a usable one (True);
    else ``convert()`` (the load that converts every expert into the backend) and the forms written for the next
    load (False)."""
    layers, experts = len(backend.experts), len(backend.experts[0]) if backend.experts else 0
    key = form_key(files, layers, experts, hidden, intermediate, backend.fmt.group_size)
    if load_forms(backend, key, intermediate):
        return True
    convert()
    save_forms(backend, key)
    return False
