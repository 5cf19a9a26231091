"""ProMoE (``promoe``): its per-layer MLP predictor with stride (``predictor.py``) and the policy (``spec.py``); the
runtime is the backend's own (early preemption, chunked low-priority prefetch, reordered inference)."""

from moeflow.offload.policies.promoe.predictor import ProMoEPredictor
from moeflow.offload.policies.promoe.spec import PROMOE

__all__ = ["PROMOE", "ProMoEPredictor"]
