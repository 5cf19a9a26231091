"""moeflow: run Mixture-of-Experts language models on one GPU that holds only part of the model."""

import os
import sys

if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    # OpenMP threads spin-wait ~3 ms by default; with the small per-expert ops of a decode step on a busy machine
    # that made the CPU path ~50x slower (0.8 vs 45 tok/s measured). Sleeping at once instead cost a quiet
    # machine's 2-thread decode 5-25 % (a sleeping thread is woken for each of a token's ~50 parallel regions):
    # spin briefly (libgomp's count, ~0.1 ms), then sleep (benchmarks/results/peers/s15/spin_t2_quiet.md).
    # A user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT wins.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = "20000"

import gc  # noqa: E402

# The imports below create ~10^5 objects (torch's among them when it is not yet imported); the cyclic collector
# ran full passes over torch's heap while they loaded (~0.06 s of moeflow's own ~0.2 s import, more when torch is
# imported here too). The collector pauses for them (the few cycles they leave are collected by a later pass) and is
# restored to the state it was in: a caller's gc.disable() is kept.
_gc_was_enabled = gc.isenabled()
gc.disable()
try:
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
finally:
    if _gc_was_enabled:
        gc.enable()
    del _gc_was_enabled

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
