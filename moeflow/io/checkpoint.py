"""Reading HF-layout checkpoints: config.json, safetensors shards through the index, quantization config.

Tensors are opened lazily with safetensors (memory-mapped), one at a time, so loading never holds a
second full copy of the model in RAM. Every error names the file and tensor at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moeflow.errors import CheckpointError, UnsupportedQuantizationError
from moeflow.quant import ctensors
from moeflow.quant.awq import SUPPORTED_GROUP_SIZES
from moeflow.quant.gptq import check_sequential_groups, gptq_qweight_to_awq, gptq_qzeros_to_awq, gptq_settings

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class QuantizationSpec:
    """What the checkpoint's quantization config says (AWQ 4-bit GEMM; GPTQ and compressed-tensors 4-bit read as
    AWQ; MXFP4 with group 32)."""

    # "awq", "gptq" / "compressed-tensors" (converted into AWQ's layout as read: :class:`GPTQCheckpointReader`,
    # :class:`CompressedTensorsReader`) or "mxfp4"
    method: str
    bits: int
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()  # compressed-tensors: its ``ignore`` list
    zero_offset: int = 0  # GPTQ: added to every stored zero point (1 in the v1 "gptq" checkpoint format)
    symmetric: bool = True  # compressed-tensors: False when each group stores its zero point

    @property
    def awq_layout(self) -> bool:
        """The experts reach the kernels as AWQ tensors (stored so, or repacked as read)."""
        return self.method in ("awq", "gptq", ctensors.METHOD)


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory, or a hub id fetched through huggingface_hub (honours HF_HUB_OFFLINE and the cache)."""
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; from_pretrained expects a checkpoint directory or a hub id")
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=text,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"],
        )
    except Exception as e:  # huggingface_hub raises many types (offline, not found, auth)
        raise CheckpointError(
            f"{text!r} is neither a local directory nor a hub id that could be fetched "
            f"(offline mode: {os.environ.get('HF_HUB_OFFLINE', '0')}): {type(e).__name__}: {e}"
        ) from e
    return Path(local)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def read_quantization(directory: Path, config: dict) -> QuantizationSpec | None:
    """The quantization spec from config.json's quantization_config, or an older quant_config.json."""
    qc = config.get("quantization_config")
    source = directory / "config.json"
    if qc is None and (directory / "quant_config.json").is_file():
        source = directory / "quant_config.json"
        old = read_json(source)
        qc = {
            "quant_method": "awq",
            "bits": old.get("w_bit", old.get("bits")),
            "group_size": old.get("q_group_size", old.get("group_size")),
            "version": old.get("version", "GEMM"),
            "zero_point": old.get("zero_point", True),
            "modules_to_not_convert": old.get("modules_to_not_convert"),
        }
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        group, offset = gptq_settings(qc, str(source))
        return QuantizationSpec("gptq", 4, group, tuple(qc.get("modules_to_not_convert") or ()), offset)
    if method == ctensors.METHOD:  # llm-compressor's W4A16 (pack-quantized)
        group, symmetric = ctensors.ct_settings(qc, str(source))
        return QuantizationSpec(method, 4, group, tuple(qc.get("ignore") or ()), symmetric=symmetric)
    if method == "mxfp4":  # gpt-oss as published: e2m1 values, one e8m0 scale per 32
        return QuantizationSpec("mxfp4", 4, 32, tuple(qc.get("modules_to_not_convert") or ()))
    if method != "awq":
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
            "(moeflow reads AWQ, GPTQ, compressed-tensors W4A16 and MXFP4)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantizationError(f"{source}: AWQ with bits={bits} is not supported (only 4-bit)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedQuantizationError(
            f"{source}: AWQ version {qc.get('version')!r} is not supported (only the GEMM layout)"
        )
    if qc.get("zero_point", True) is False:
        raise UnsupportedQuantizationError(f"{source}: AWQ without zero point is not supported")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedQuantizationError(
            f"{source}: AWQ group_size={group} is not supported (supported: {SUPPORTED_GROUP_SIZES})"
        )
    return QuantizationSpec("awq", 4, int(group), tuple(qc.get("modules_to_not_convert") or ()))


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint directory, wherever the index puts them."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._handles: dict[Path, object] = {}
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            index = read_json(index_path)
            if "weight_map" not in index:
                raise CheckpointError(f"{index_path} has no 'weight_map'")
            self.weight_map = {name: directory / f for name, f in index["weight_map"].items()}
            for f in sorted(set(self.weight_map.values())):
                if not f.is_file():
                    raise CheckpointError(f"missing weight file {f} (listed in {index_path})")
        elif (directory / SINGLE_NAME).is_file():
            self.weight_map = {}
            self._index_file(directory / SINGLE_NAME)
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"no weights in {directory}: expected {SINGLE_NAME} or {INDEX_NAME} with its shards"
                )
            self.weight_map = {}
            for f in files:
                self._index_file(f)

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): {e}") from e
            self._handles[path] = handle
        return handle

    def _index_file(self, path: Path) -> None:
        for name in self._open(path).keys():
            self.weight_map[name] = path

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def over(self, inner: CheckpointReader) -> CheckpointReader:
        """This reader's conversion over another reader of the same checkpoint's tensors (the disk tier's expert
        index); a plain reader converts nothing: ``inner`` itself. Converting readers override it."""
        return inner

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor (CPU). ``shape``: the shape config.json implies; a mismatch is an error."""
        path = self.weight_map.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        try:
            t = self._open(path).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): {e}") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {path.name} has shape {tuple(t.shape)}, but config.json implies {tuple(shape)}"
            )
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, read from the file's header (no data is read)."""
        path = self.weight_map.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return tuple(self._open(path).get_slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()


def get_slice(reader: CheckpointReader, name: str, index: int, full_shape: tuple[int, ...]) -> torch.Tensor:
    """Row ``index`` of a stacked tensor (e.g. one expert of a fused [E, ...] tensor) without reading the rest."""
    path = reader.weight_map.get(name)
    if path is None:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {reader.directory}")
    try:
        sl = reader._open(path).get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(full_shape):
            raise CheckpointError(
                f"tensor {name!r} in {path.name} has shape {shape}, but config.json implies {tuple(full_shape)}"
            )
        return sl[index]
    except SafetensorError as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): {e}") from e


class ConvertingReader(CheckpointReader):
    """A reader that converts some tensors of another reader as they are read (GPTQ, compressed-tensors). It works
    over any reader of the checkpoint's tensors: the checkpoint's own, or the disk tier's expert index, which
    records and reads the stored tensors and converts them through :meth:`over`."""

    def __init__(self, inner: CheckpointReader, quant: QuantizationSpec):
        self.inner, self.quant = inner, quant
        self.directory, self.weight_map = inner.directory, inner.weight_map

    def over(self, inner: CheckpointReader) -> ConvertingReader:
        """The same conversion over another reader of the same checkpoint's tensors."""
        return type(self)(inner, self.quant)

    def _open(self, path: Path):
        return self.inner._open(path)

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def names(self) -> list[str]:
        return self.inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def close(self) -> None:
        self.inner.close()


class GPTQCheckpointReader(ConvertingReader):
    """A GPTQ checkpoint read as if it were AWQ: every ``qweight`` / ``qzeros`` is repacked into AWQ's layout
    as it is read (``scales``, biases and unquantized tensors pass through), after checking the layer's
    ``g_idx`` (no act-order). The loaders above it see one quantized format."""

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if not name.endswith((".qweight", ".qzeros")):
            return self.inner.get(name, shape)
        module = name.rsplit(".", 1)[0]
        raw = self.inner.get(name)
        if name.endswith(".qweight"):
            if f"{module}.g_idx" in self:
                check_sequential_groups(self.inner.get(f"{module}.g_idx"), self.quant.group_size, f"{module}.g_idx")
            t = gptq_qweight_to_awq(raw)
        else:
            t = gptq_qzeros_to_awq(raw, self.quant.zero_offset, name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} (GPTQ, shape {tuple(raw.shape)}) has AWQ shape {tuple(t.shape)} "
                                  f"once repacked, but config.json implies {tuple(shape)}")
        return t


class CompressedTensorsReader(ConvertingReader):
    """A compressed-tensors W4A16 checkpoint read as if it were AWQ. For a module ``X`` stored packed
    (``X.weight_packed``):

    * ``X.qweight`` / ``X.qzeros`` / ``X.scales`` are the AWQ tensors of the same weights
      (:mod:`moeflow.quant.ctensors`), what the experts and the AWQ attention linears load;
    * ``X.weight`` is the weight dequantized as compressed-tensors does it (in the scale dtype), for the modules
      moeflow keeps 16-bit (the embedding or lm_head when quantized, MLA projections, ...).

    Everything else (the ``ignore`` list's 16-bit weights, norms, biases) passes through."""

    def _packed(self, name: str) -> tuple[str, str] | None:
        """(module, part) when ``name`` is a tensor this reader makes from ``module.weight_packed``."""
        module, _, part = name.rpartition(".")
        if part in ("qweight", "qzeros", "scales", "weight") and f"{module}.weight_packed" in self.inner:
            return module, part
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.inner or self._packed(name) is not None

    def names(self) -> list[str]:
        out = []
        for name in self.inner.names():
            module, _, part = name.rpartition(".")
            if part == "weight_packed":
                out += [f"{module}.qweight", f"{module}.qzeros", f"{module}.scales"]
            elif part not in ("weight_scale", "weight_zero_point", "weight_shape"):
                out.append(name)
        return out

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        found = None if name in self.inner else self._packed(name)
        if found is None:
            return self.inner.get(name, shape)
        module, part = found
        t = self._convert(module, part)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} (compressed-tensors, from {module}.weight_packed of shape "
                                  f"{self.inner.shape(module + '.weight_packed')}) has shape {tuple(t.shape)}, "
                                  f"but config.json implies {tuple(shape)}")
        return t

    def _convert(self, module: str, part: str) -> torch.Tensor:
        n, words = self.inner.shape(f"{module}.weight_packed")
        groups = self.inner.shape(f"{module}.weight_scale")[-1]
        if groups * self.quant.group_size != words * 8:
            raise CheckpointError(
                f"{module}: weight_packed holds {words * 8} input features and weight_scale {groups} groups, which "
                f"is not config.json's group_size={self.quant.group_size}")
        if part == "scales":
            return ctensors.ct_scales_to_awq(self.inner.get(f"{module}.weight_scale"), f"{module}.weight_scale")
        if part == "qweight":
            return ctensors.ct_qweight_to_awq(self.inner.get(f"{module}.weight_packed"), f"{module}.weight_packed")
        zp_name = f"{module}.weight_zero_point"
        if not self.quant.symmetric and zp_name not in self.inner:
            raise CheckpointError(f"tensor {zp_name!r} is missing: config.json's quantization is asymmetric")
        zero_point = None if self.quant.symmetric else self.inner.get(zp_name)
        if part == "qzeros":
            return ctensors.ct_qzeros_to_awq(zero_point, n, groups, zp_name)
        packed, scale = self.inner.get(f"{module}.weight_packed"), self.inner.get(f"{module}.weight_scale")
        return ctensors.ct_dequantize(packed, scale, zero_point, f"{module}.weight")

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.inner:
            return self.inner.shape(name)
        return tuple(self.get(name).shape)


def open_checkpoint(directory: Path, quant: QuantizationSpec | None) -> CheckpointReader:
    """The reader for ``directory``: GPTQ checkpoints through :class:`GPTQCheckpointReader`, compressed-tensors
    ones through :class:`CompressedTensorsReader`."""
    if quant is not None and quant.method == "gptq":
        return GPTQCheckpointReader(CheckpointReader(directory), quant)
    if quant is not None and quant.method == ctensors.METHOD:
        return CompressedTensorsReader(CheckpointReader(directory), quant)
    return CheckpointReader(directory)
