"""Expert weight formats, one module each, and the registry that resolves one from a checkpoint's storage.

A format (:class:`ExpertFormat`) owns one expert's byte layout, the conversion from the checkpoint's tensors,
its compute (kernels, fp32 reference, CPU form) and its capabilities; callers ask the object. This registry is the
only place that maps storage names (``"dense"``, ``"awq"``, ``"mxfp4"``, ``"gguf"``) to format classes;
docs/design.md ("How to add a weight format") says where a new format goes.
"""

from moeflow.kernels.formats.awq import AWQFormat
from moeflow.kernels.formats.biased import ACTIVATIONS, BiasedAWQFormat, BiasedDenseFormat, BiasedExpertFormat
from moeflow.kernels.formats.dense import DenseFormat
from moeflow.kernels.formats.gguf import GGUFFormat
from moeflow.kernels.formats.layout import ALIGN, ExpertFormat, ReferenceWeights, TensorSpec
from moeflow.kernels.formats.mxfp4 import MXFP4Format
from moeflow.kernels.formats.plain import PlainFormat
from moeflow.kernels.formats.registry import FORMATS, biased_expert_format, expert_format, gguf_expert_format

__all__ = ["ACTIVATIONS", "ALIGN", "AWQFormat", "BiasedAWQFormat", "BiasedDenseFormat", "BiasedExpertFormat",
           "DenseFormat", "ExpertFormat", "FORMATS", "GGUFFormat", "MXFP4Format", "PlainFormat", "ReferenceWeights",
           "TensorSpec", "biased_expert_format", "expert_format", "gguf_expert_format"]
