"""ExpertFlow (``expertflow``): the routing-path predictor (``predictor.py``), PLEC's cache engine (``runtime.py``),
the token scheduler (``scheduler.py``), the dual-batch decode pipeline (``pipeline.py``, the policy's decode
strategy) and the policy (``spec.py``)."""

from moeflow.offload.policies.expertflow.predictor import ExpertFlowPredictor
from moeflow.offload.policies.expertflow.runtime import PLECEviction, PLECPredictor, PLECState
from moeflow.offload.policies.expertflow.scheduler import activated_pairs, group_by_routing, regroup_two_batches
from moeflow.offload.policies.expertflow.spec import EXPERTFLOW

__all__ = ["EXPERTFLOW", "ExpertFlowPredictor", "PLECEviction", "PLECPredictor", "PLECState", "activated_pairs",
           "group_by_routing", "regroup_two_batches"]
