"""DuoServe-MoE (``duoserve``): its ExpertMLP predictor (``predictor.py``), the prediction stream that runs it beside
the expert compute (``runtime.py``) and the policy (``spec.py``)."""

from moeflow.offload.policies.duoserve.predictor import DuoServePredictor
from moeflow.offload.policies.duoserve.runtime import OverlappedPredictor
from moeflow.offload.policies.duoserve.spec import DUOSERVE

__all__ = ["DUOSERVE", "DuoServePredictor", "OverlappedPredictor"]
