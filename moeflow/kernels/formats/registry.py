"""Storage name -> format class: the one place that reads a format's name (``"dense"``, ``"awq"``, ``"mxfp4"``,
``"gguf"``).

Plain formats (SiLU, no biases) and biased ones (a bias and/or another gate activation: gpt-oss) are separate
classes; :func:`expert_format` and :func:`biased_expert_format` pick the class of a storage name, the way the
checkpoint reader and the custom ops (which carry the name as a string argument) rebuild a format.
"""

from __future__ import annotations

import functools

import torch

from moeflow.kernels.formats.awq import AWQFormat
from moeflow.kernels.formats.biased import BiasedAWQFormat, BiasedDenseFormat, BiasedExpertFormat
from moeflow.kernels.formats.dense import DenseFormat
from moeflow.kernels.formats.gguf import GGUFFormat, gguf_expert_format
from moeflow.kernels.formats.layout import ExpertFormat
from moeflow.kernels.formats.mxfp4 import MXFP4Format

# (storage name, biased) -> class
FORMATS: dict[tuple[str, bool], type[ExpertFormat]] = {
    ("dense", False): DenseFormat, ("awq", False): AWQFormat,
    ("dense", True): BiasedDenseFormat, ("awq", True): BiasedAWQFormat, ("mxfp4", True): MXFP4Format,
    ("gguf", False): GGUFFormat,  # built by gguf_expert_format (formats/gguf.py; its block types are fields)
}


def _class(kind: str, biased: bool) -> type[ExpertFormat]:
    cls = FORMATS.get((kind, biased))
    if cls is None:
        known = sorted({k for k, b in FORMATS if b == biased})
        raise ValueError(f"unknown {'biased ' if biased else ''}expert format kind {kind!r} (expected one of {known})")
    return cls


def expert_format(hidden_size: int, intermediate_size: int, kind: str, dtype: torch.dtype,
                  group_size: int | None = None) -> ExpertFormat:
    """The plain format (SiLU, no biases) stored as ``kind``: ``"dense"`` (``dtype`` the weights') or ``"awq"``
    (``dtype`` the scales', ``group_size`` AWQ's group)."""
    return _class(kind, False)(hidden_size, intermediate_size, dtype, group_size)


@functools.lru_cache(maxsize=64)
def biased_expert_format(hidden_size: int, intermediate_size: int, kind: str, dtype: torch.dtype,
                         group_size: int | None = None, *, activation: str = "silu", bias: bool = True,
                         swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> BiasedExpertFormat:
    """The biased format stored as ``kind`` (``"dense"``, ``"awq"`` or ``"mxfp4"``, whose group is 32)."""
    cls = _class(kind, True)
    return cls(hidden_size, intermediate_size, dtype, group_size, activation=activation, bias=bias,
               swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


__all__ = ["FORMATS", "biased_expert_format", "expert_format", "gguf_expert_format"]
