"""moeflow: run Mixture-of-Experts language models on one GPU that holds only part of the model."""

import os
import sys

if "torch" not in sys.modules:
    # OpenMP threads spin-wait by default; with the small per-expert ops of a decode step on a busy machine
    # that made the CPU path ~50x slower (0.8 vs 45 tok/s measured). Sleep instead, unless the user chose.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from moeflow.api import CausalLMOutput, MoEModel, MoEOffloadedMixtral  # noqa: E402
from moeflow.config import OffloadConfig  # noqa: E402
from moeflow.engine.sampling import GenerationConfig  # noqa: E402
from moeflow.errors import (  # noqa: E402
    CheckpointError,
    InputError,
    MoeflowError,
    SchedulingError,
    UnsupportedQuantizationError,
)
from moeflow.offload.policies import POLICY_NAMES as POLICIES  # noqa: E402  (the built-in policy names)

__version__ = "0.1.0"

__all__ = [
    "MoEModel",
    "MoEOffloadedMixtral",
    "OffloadConfig",
    "POLICIES",
    "GenerationConfig",
    "CausalLMOutput",
    "MoeflowError",
    "CheckpointError",
    "UnsupportedQuantizationError",
    "InputError",
    "SchedulingError",
]
