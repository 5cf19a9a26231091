"""A GGUF model's token embedding used as stored: :class:`StoredEmbedding` (issue 37's cold start).

The embedding is the largest non-expert tensor a load dequantizes (a 32k x 4096 table: 524 MB of fp32 and ~0.5 CPU
seconds from F16 or Q4_K), and a step reads a few of its rows. On ``device="cpu"`` with ``from_pretrained(mmap=
True)`` the decoder's ``embed_tokens`` is this module instead: the table's blocks as a view of the mapped file,
the rows of a lookup dequantized when looked up (:func:`moeflow.quant.ggml.dequantize`, row by row as the whole
table's dequantization, so the same values as ``nn.Embedding`` over the dequantized table, then in the model's
dtype; K-quant rows by the native library's :func:`~moeflow.kernels.cpu.gguf.dequantize_rows`, the same bits). A
tied lm_head still reads the tensor from the file at load (quantized there).
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.io.gguf import GGUFModel
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.kernels.cpu.gguf import DEQUANT_TYPES, dequantize_rows
from moeflow.kernels.cpu.native import native_available
from moeflow.quant.ggml import dequantize, ggml_type


class StoredEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a GGUF tensor's rows as stored: ``raw`` uint8 [V, row_bytes] of ggml type
    ``type_id`` (its rows dequantize to ``embedding_dim`` values); ``dtype``: the output's. ``raw`` is not a
    parameter or buffer (no checkpoint name, never moved): a view of the mapped file."""

    def __init__(self, raw: torch.Tensor, type_id: int, embedding_dim: int, dtype: torch.dtype, what: str) -> None:
        super().__init__()
        self.raw, self.type_id, self.dtype, self.what = raw, type_id, dtype, what
        self.num_embeddings, self.embedding_dim = raw.shape[0], embedding_dim
        # K-quant rows by the native library where it builds (the same bits; ~0.1 ms less per decoded token)
        self.native = ggml_type(type_id, what).name in DEQUANT_TYPES and raw.device.type == "cpu" and \
            native_available()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int [...] -> [..., embedding_dim] in ``dtype`` (IndexError for an id outside the table)."""
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside the embedding table ({self.num_embeddings} rows of {self.what})")
        picked = self.raw.index_select(0, flat)
        rows = dequantize_rows(picked, self.type_id, self.embedding_dim) if self.native else \
            dequantize(picked, self.type_id, self.what)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored as ggml type {self.type_id} ({self.what})"


def use_stored_embedding(decoder: nn.Module, gguf: GGUFModel, name: str, dtype: torch.dtype,
                         mapping: MappedGGUF) -> bool:
    """Replace ``decoder.embed_tokens`` (an ``nn.Embedding``) by a :class:`StoredEmbedding` over the GGUF tensor
    answering HF name ``name``; False (nothing changed) when the file stores it otherwise (joined, absent, or a
    shape the module does not have)."""
    embed = getattr(decoder, "embed_tokens", None)
    found = gguf.reader.resolve(name)
    if not isinstance(embed, nn.Embedding) or found is None or found[1] is not None:
        return False
    info = found[0]
    if info.shape != (embed.num_embeddings, embed.embedding_dim):
        return False
    what = f"{info.path}: tensor {info.name!r}"
    raw = mapping.view(info.path, info.offset, info.nbytes, f"tensor {info.name!r}").view(info.shape[0], -1)
    decoder.embed_tokens = StoredEmbedding(raw, info.type.id, embed.embedding_dim, dtype, what)
    return True
