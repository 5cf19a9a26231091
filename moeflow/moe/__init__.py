"""The MoE layer: routing (:mod:`.routing`), the block (:mod:`.block`), the backend seam (:mod:`.backend`) and
the backends that keep every expert in one place (:mod:`.resident`); the offloading backends live in
:mod:`moeflow.offload`."""

from moeflow.moe.backend import ExpertBackend, StepInfo
from moeflow.moe.block import MoEBlock, RoutingRecorder
from moeflow.moe.resident import CpuInt4Experts, ResidentExperts
from moeflow.moe.routing import RouterSpec, make_router, route, softmax_topk

__all__ = [
    "route", "softmax_topk", "make_router", "RouterSpec", "ExpertBackend", "StepInfo", "ResidentExperts",
    "CpuInt4Experts", "MoEBlock", "RoutingRecorder",
]
