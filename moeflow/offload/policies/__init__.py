"""The named offload policies: one folder per paper plus the baselines, and the table that names them.

A paper's folder (``duoserve/``, ``promoe/``, ``finemoe/``, ``expertflow/``,
``mixtral_offloading/``) holds everything of it: its learned
predictor (``predictor.py``), what runs it in the backend (``runtime.py``), its :class:`PolicySpec` (``spec.py``)
and whatever else the paper defines (FineMoE's map store, ExpertFlow's token scheduler and dual-batch pipeline).

``POLICY_TABLE`` is the whole list of built-in policies, written out here (no module registers itself on
import); ``POLICY_NAMES`` is its keys. ``register_policy`` adds a policy of the user's (a custom
predictor or eviction policy) under a new name; it never replaces a built-in one.
"""

from __future__ import annotations

from collections.abc import Mapping

# the predictor package first: its table of kinds imports the papers' predictors from the folders below, which
# import its ``base``; loaded in this order, each module is complete when the next one reads it
import moeflow.offload.predictors  # noqa: F401, I001
from moeflow.errors import SchedulingError
from moeflow.offload.policies.auto import AUTO, choose_policy
from moeflow.offload.policies.baselines import (
    FIDDLER,
    LFU,
    LRU,
    ONDEMAND,
    RESIDENT,
    STATIC,
)
from moeflow.offload.policies.duoserve import DUOSERVE, OverlappedPredictor
from moeflow.offload.policies.expertflow import EXPERTFLOW, PLECEviction, PLECPredictor, PLECState
from moeflow.offload.policies.finemoe import FINEMOE, FineMoERuntime
from moeflow.offload.policies.mixtral_offloading import MIXTRAL_OFFLOADING
from moeflow.offload.policies.promoe import PROMOE
from moeflow.offload.policies.spec import PolicyContext, PolicySpec, evict

POLICY_TABLE: Mapping[str, PolicySpec] = {
    spec.name: spec
    for spec in (RESIDENT, ONDEMAND, LRU, LFU, STATIC, MIXTRAL_OFFLOADING, FIDDLER,  # baselines.py, mixtral_offloading/
                 DUOSERVE, PROMOE, FINEMOE, AUTO, EXPERTFLOW)  # one folder per paper; auto.py picks among them
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICY_TABLE)

_user_policies: dict[str, PolicySpec] = {}


def registered_policies() -> dict[str, PolicySpec]:
    """Every policy a config may name: the built-in table, then the user's."""
    return {**POLICY_TABLE, **_user_policies}


def register_policy(spec: PolicySpec) -> None:
    """Add a user policy under a new name (ValueError when the name is taken)."""
    if spec.name in POLICY_TABLE or spec.name in _user_policies:
        raise ValueError(f"offload policy {spec.name!r} is already registered")
    _user_policies[spec.name] = spec


def unregister_policy(name: str) -> None:
    """Remove a user policy (built-in ones cannot be removed)."""
    if name in POLICY_TABLE:
        raise ValueError(f"offload policy {name!r} is built in")
    _user_policies.pop(name, None)


def get_policy(name: str, table: Mapping[str, PolicySpec] | None = None) -> PolicySpec:
    """The policy called ``name`` in ``table`` (default: :func:`registered_policies`); SchedulingError listing
    the known ones otherwise."""
    table = registered_policies() if table is None else table
    if name not in table:
        known = ", ".join(repr(p) for p in table)
        raise SchedulingError(f"unknown offload policy {name!r}; known policies: {known}")
    return table[name]


__all__ = [
    "POLICY_TABLE", "POLICY_NAMES", "PolicySpec", "PolicyContext", "evict", "get_policy", "register_policy",
    "unregister_policy", "registered_policies", "choose_policy", "OverlappedPredictor", "FineMoERuntime",
    "PLECPredictor", "PLECEviction", "PLECState",
]
