"""moeflow: run Mixture-of-Experts language models on one GPU that holds only part of the model."""

from moeflow.config import OffloadConfig
from moeflow.errors import (
    CheckpointError,
    InputError,
    MoeflowError,
    SchedulingError,
    UnsupportedQuantizationError,
)
from moeflow.models.generation import GenerationConfig
from moeflow.models.offloaded import CausalLMOutput, MoEOffloadedMixtral

__version__ = "0.1.0"

__all__ = [
    "MoEOffloadedMixtral",
    "OffloadConfig",
    "GenerationConfig",
    "CausalLMOutput",
    "MoeflowError",
    "CheckpointError",
    "UnsupportedQuantizationError",
    "InputError",
    "SchedulingError",
]
