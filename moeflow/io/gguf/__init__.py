"""GGUF models (llama.cpp's files) read as moeflow checkpoints: :func:`open_gguf`.

``files`` finds and opens the file(s), ``config`` turns the metadata into the family's config.json, ``reader``
answers the family's tensor names (dequantized, q/k rows un-permuted), ``experts`` gives each expert's bytes as
stored, ``tokenizer`` rebuilds the tokenizer and chat template. Needs gguf-py (``pip install 'moeflow[gguf]'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moeflow.errors import CheckpointError
from moeflow.io.gguf.config import supported_architectures
from moeflow.io.gguf.experts import (
    ExpertBytes,
    ExpertConvert,
    ExpertSlice,
    GGUFExpertSource,
    dense_expert_tensors,
    q4_0_awq_expert_tensors_reference,
)
from moeflow.io.gguf.files import SPLIT, GGUFFiles, find_gguf, is_gguf_path
from moeflow.io.gguf.reader import GGUFCheckpointReader, open_gguf_reader

__all__ = ["GGUFModel", "open_gguf", "resolve_gguf", "ExpertSlice", "ExpertBytes", "ExpertConvert",
           "GGUFExpertSource", "GGUFCheckpointReader", "dense_expert_tensors", "q4_0_awq_expert_tensors_reference",
           "supported_architectures"]


@dataclass
class GGUFModel:
    """One opened GGUF model: its files, config.json (a dict) and the HF-named reader over its tensors."""

    files: GGUFFiles
    config: dict
    reader: GGUFCheckpointReader

    @property
    def path(self) -> Path:
        return self.files.path

    @property
    def directory(self) -> Path:
        return self.files.path.parent

    def tokenizer_directory(self) -> Path | None:
        """A directory with the tokenizer files rebuilt from the metadata (cached), or None (see tokenizer.py)."""
        from moeflow.io.gguf.tokenizer import tokenizer_directory

        return tokenizer_directory(self.files, self.config["model_type"])

    def expert_types(self, blocks: tuple[int, ...]) -> set[str]:
        """The ggml types of the stacked expert tensors of decoder layers ``blocks`` (``ffn_{gate,up,down}_exps``)."""
        return {info.type.name for b in blocks for p in ("gate", "up", "down")
                if (info := self.files.tensors.get(f"blk.{b}.ffn_{p}_exps.weight")) is not None}

    def projection_types(self, blocks: tuple[int, ...]) -> dict[str, set[str]]:
        """The ggml types of each projection's stacked experts over decoder layers ``blocks``: "gate" / "up" /
        "down" -> type names (a Q4_K_M file mixes Q4_K and Q6_K down projections between layers)."""
        return {p: {info.type.name for b in blocks
                    if (info := self.files.tensors.get(f"blk.{b}.ffn_{p}_exps.weight")) is not None}
                for p in ("gate", "up", "down")}

    def expert_source(self, blocks: tuple[int, ...], num_experts: int, hidden: int, intermediate: int,
                      convert: ExpertConvert = dense_expert_tensors) -> GGUFExpertSource:
        """The experts of decoder layers ``blocks`` (one per MoE layer, in order), read as stored and converted
        by ``convert``."""
        return GGUFExpertSource(self.files, blocks, num_experts, hidden, intermediate, convert)


def resolve_gguf(path_or_id: str | os.PathLike, gguf_file: str | None = None,
                 revision: str | None = None) -> Path | None:
    """The GGUF file ``from_pretrained`` was pointed at, or None for an HF-layout checkpoint: a ``.gguf`` path; a
    directory with ``gguf_file``, or holding a ``.gguf`` and no config.json; a hub id with ``gguf_file`` (fetched
    through huggingface_hub, every part of a split set)."""
    p = Path(path_or_id).expanduser()
    if is_gguf_path(p) and gguf_file is None:
        if not p.is_file():
            raise CheckpointError(f"GGUF file {p} does not exist")
        return p
    if p.is_dir():
        if gguf_file is None and (p / "config.json").is_file():
            return None
        return find_gguf(p, gguf_file)
    if gguf_file is None:
        return None
    return _hub_gguf(str(path_or_id), gguf_file, revision)


def _hub_gguf(repo: str, gguf_file: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import hf_hub_download

        first = Path(hf_hub_download(repo, gguf_file, revision=revision))
        m = SPLIT.match(Path(gguf_file).name)
        if m is not None:
            parent = str(Path(gguf_file).parent)
            for i in range(2, int(m["count"]) + 1):
                name = f"{m['stem']}-{i:05d}-of-{m['count']}.gguf"
                hf_hub_download(repo, name if parent == "." else f"{parent}/{name}", revision=revision)
    except Exception as e:  # huggingface_hub raises many types (offline, not found, auth)
        raise CheckpointError(f"{repo!r} / gguf_file={gguf_file!r}: neither a local path nor a hub file that could "
                              f"be fetched (offline mode: {os.environ.get('HF_HUB_OFFLINE', '0')}): "
                              f"{type(e).__name__}: {e}") from e
    return first


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open the GGUF model at ``path`` (a file; a split set's first part): CheckpointError naming the file when it is
    truncated, not GGUF, of an unsupported architecture or a split set with a part missing."""
    reader, config = open_gguf_reader(path)
    return GGUFModel(reader.files, config, reader)
