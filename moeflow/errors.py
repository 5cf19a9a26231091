"""Exceptions raised by moeflow. Every message names the file, tensor or argument at fault."""

from __future__ import annotations


class MoeflowError(Exception):
    """Base class of every error moeflow raises on bad input (besides ValueError for arguments)."""


class CheckpointError(MoeflowError):
    """A checkpoint directory, file or tensor is missing, corrupt or disagrees with config.json."""


class UnsupportedQuantizationError(CheckpointError):
    """The checkpoint's quantization method or bit width is not one moeflow reads."""


class InputError(MoeflowError, ValueError):
    """Model inputs are invalid: ids outside the vocabulary, prompt longer than the context, ..."""


class SchedulingError(MoeflowError):
    """The offload configuration cannot work (too few slots, unknown policy, ...)."""
