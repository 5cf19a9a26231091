"""FineMoE (``finemoe``): the Expert Map Store (``store.py``), its search as a predictor (``predictor.py``), the
runtime that drives it pass by pass (``runtime.py``) and the policy (``spec.py``)."""

from moeflow.offload.policies.finemoe.predictor import FineMoEPredictor
from moeflow.offload.policies.finemoe.runtime import FineMoERuntime
from moeflow.offload.policies.finemoe.spec import FINEMOE
from moeflow.offload.policies.finemoe.store import ExpertMapStore

__all__ = ["FINEMOE", "ExpertMapStore", "FineMoEPredictor", "FineMoERuntime"]
