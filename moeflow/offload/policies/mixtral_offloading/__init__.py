"""mixtral-offloading (``mixtral-offloading``): the next router on the current input as a trace-level predictor
(``predictor.py``, kind "skip-gate"), the same speculation in the runtime (``runtime.py``) and the policy
(``spec.py``)."""

from moeflow.offload.policies.mixtral_offloading.predictor import SkipGatePredictor
from moeflow.offload.policies.mixtral_offloading.runtime import GateSpeculator
from moeflow.offload.policies.mixtral_offloading.spec import MIXTRAL_OFFLOADING

__all__ = ["MIXTRAL_OFFLOADING", "GateSpeculator", "SkipGatePredictor"]
