"""Storage name -> format class: the one place that reads a format's name (``"dense"``, ``"awq"``, ``"mxfp4"``,
``"gguf"``).

Plain formats (SiLU, no biases) and biased ones (a bias and/or another gate activation: gpt-oss) are separate
classes; :func:`expert_format` and :func:`biased_expert_format` pick the class of a storage name, the way the
checkpoint reader and the custom ops (which carry the name as a string argument) rebuild a format.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from moeflow.kernels.formats.awq import AWQFormat
from moeflow.kernels.formats.biased import BiasedAWQFormat, BiasedDenseFormat, BiasedExpertFormat
from moeflow.kernels.formats.dense import DenseFormat
from moeflow.kernels.formats.gguf import GGUFFormat
from moeflow.kernels.formats.layout import ExpertFormat
from moeflow.kernels.formats.mxfp4 import MXFP4Format
from moeflow.kernels.gguf_reference import ggml_type

# (storage name, biased) -> class
FORMATS: dict[tuple[str, bool], type[ExpertFormat]] = {
    ("dense", False): DenseFormat, ("awq", False): AWQFormat,
    ("dense", True): BiasedDenseFormat, ("awq", True): BiasedAWQFormat, ("mxfp4", True): MXFP4Format,
    ("gguf", False): GGUFFormat,  # built by gguf_expert_format (its block types are fields)
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


def gguf_expert_format(gate_up_types: str | int | Sequence[str | int], down_types: str | int | Sequence[str | int],
                       hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> GGUFFormat:
    """The GGUF format whose ``ffn_gate_exps`` / ``ffn_up_exps`` hold ggml type(s) ``gate_up_types`` and
    ``ffn_down_exps`` ``down_types``: each a type (a name such as ``"Q4_K"``, a ggml type id, a
    ``gguf.GGMLQuantizationType``) or the sequence of the (at most two) types a model's layers use, e.g.
    ``("Q4_K", "Q6_K")`` for Q4_K_M's down projections. ``dtype`` is the model's activation dtype. A ValueError
    names the supported types (:data:`moeflow.kernels.gguf_reference.GGML_TYPES`)."""
    def names(types) -> tuple[str, ...]:
        seq = [types] if isinstance(types, str | int) else list(types)
        return tuple(sorted({ggml_type(t).name for t in seq}, key=lambda n: ggml_type(n).code))

    return _gguf_format(names(gate_up_types), names(down_types), hidden_size, intermediate_size, dtype)


@functools.lru_cache(maxsize=64)
def _gguf_format(gate_up: tuple[str, ...], down: tuple[str, ...], hidden: int, inter: int,
                 dtype: torch.dtype) -> GGUFFormat:
    return GGUFFormat(hidden, inter, dtype, gate_up_types=gate_up, down_types=down)
