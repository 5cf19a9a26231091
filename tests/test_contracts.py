"""Declared contracts hold: the offloading backend's collaborators (moeflow/offload/contracts.py, ``LoadQueue`` in
copy_engine.py, ``PrefetchTarget`` in predictors/interface.py, ``DevicePart`` in moe/backend.py) and the serving
engine's (engine/served.py): every member a Protocol declares exists on each implementation, methods with the
same parameters, so a Protocol and its classes cannot drift apart unnoticed (no static type checker runs in this
project)."""

from __future__ import annotations

import inspect

import pytest

from moeflow.api import MoEModel
from moeflow.engine.continuous import ContinuousEngine
from moeflow.engine.served import DraftHost, ServedModel
from moeflow.moe.backend import DevicePart, ExpertBackend
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.contracts import LoadQueue, PreludeStage, SlotLoads
from moeflow.offload.copy_engine import CopyEngine
from moeflow.offload.device_step import DeviceGraphs
from moeflow.offload.disk_tier import StagedCopyEngine
from moeflow.offload.predictors.interface import PrefetchTarget
from moeflow.offload.prelude import PreludeCapture
from moeflow.offload.slot_loads import SlotLoader
from moeflow.sim.engine import SimCopyEngine


def protocol_members(proto: type) -> dict[str, object]:
    """The members ``proto`` declares itself: methods (name -> function) and attributes (name -> None)."""
    out: dict[str, object] = {name: None for name in getattr(proto, "__annotations__", {})}
    for name, value in vars(proto).items():
        if not name.startswith("__") and (inspect.isfunction(value) or isinstance(value, property)):
            out[name] = value
    return out


def instance_attributes(cls: type) -> set[str]:
    """Attributes the ``__init__`` of ``cls`` and of its bases assign (``self.x = ...``, ``self.x: T = ...``,
    ``self.x, self.y = ...``), read from their source."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        for line in inspect.getsource(init).splitlines():
            line = line.strip()
            if line.startswith("self.") and "=" in line:
                targets = line.split("=")[0].split(",")
                names |= {t.split(":")[0].strip().removeprefix("self.") for t in targets}
    return names


CASES = [
    (SlotLoads, SlotLoader), (PrefetchTarget, SlotLoader), (PreludeStage, PreludeCapture),
    (LoadQueue, CopyEngine), (LoadQueue, StagedCopyEngine), (LoadQueue, SimCopyEngine), (DevicePart, DeviceGraphs),
    (DraftHost, ContinuousEngine), (ServedModel, MoEModel),
]


@pytest.mark.parametrize(("proto", "impl"), CASES, ids=[f"{p.__name__}-{i.__name__}" for p, i in CASES])
def test_the_implementation_has_every_declared_member(proto, impl):
    members = protocol_members(proto)
    assert members, proto
    attrs = instance_attributes(impl)
    for name, declared in members.items():
        if declared is None or isinstance(declared, property):  # a data member: a class attribute or set in __init__
            assert hasattr(impl, name) or name in attrs, f"{impl.__name__} lacks {proto.__name__}.{name}"
            continue
        method = getattr(impl, name, None)
        assert callable(method), f"{impl.__name__} lacks {proto.__name__}.{name}()"
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(method).parameters)
        assert got[: len(want)] == want, f"{impl.__name__}.{name}{got} does not take {proto.__name__}.{name}{want}"


def test_the_backend_holds_collaborators_instead_of_mixing_them_in():
    assert OffloadedExperts.__bases__ == (ExpertBackend,)
    assert "__getattr__" not in vars(StagedCopyEngine)  # every LoadQueue call delegated by name
