"""The experts' load started before the decoder is built (``engine.build.early_expert_load``, CPU offloading into
a plain host store): the store it fills is bit for bit the one a sequential load fills, whatever order the
loader threads finish in; a read error is raised naming the file; a failed build stops the loader. ~5 s."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

import moeflow
import moeflow.engine.build as build
import moeflow.io.expert_index as expert_index
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.parallel_load import load_experts
from moeflow.errors import CheckpointError
from moeflow.families import family_for_config
from moeflow.io.checkpoint import CheckpointReader, read_json, read_quantization
from moeflow.offload.host_store import HostStore

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
OFFLOAD = OffloadConfig(policy="lru", gpu_expert_slots=4)

pytestmark = pytest.mark.usefixtures("calibration_cache")


@pytest.fixture
def early_loads(monkeypatch):
    """The ExpertLoad objects the builds start."""
    made = []
    real = build.early_expert_load

    def record(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(build, "early_expert_load", record)
    return made


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("moeflow-load")]


def test_early_store_equals_the_sequential_store_bitwise(early_loads, monkeypatch):
    rng, real = random.Random(3), expert_index._preadv
    monkeypatch.setattr(expert_index, "_preadv",  # reads finish in a random order across the loader threads
                        lambda fd, buf, off: (time.sleep(rng.random() * 0.002), real(fd, buf, off))[1])
    model = MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu", offload=OFFLOAD)
    assert len(early_loads) == 1 and early_loads[0] is not None and model.experts.host is early_loads[0].store
    raw = read_json(MODEL / "config.json")
    family = family_for_config(raw, "config.json")
    reader = CheckpointReader(MODEL)
    index = build.open_expert_index(reader, family, family.detect_expert_layout(reader), read_quantization(MODEL, raw))
    store = HostStore(model.experts.host.fmt, index.num_layers, index.num_experts, pin=False, device="cpu")
    load_experts(index, store.write, workers=1)
    index.close()
    assert torch.equal(store.buffer, model.experts.host.buffer)
    model.close()


def test_a_read_error_names_the_file(early_loads, monkeypatch):
    real = expert_index._preadv
    calls = []

    def failing(fd, buf, off):
        calls.append(off)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return real(fd, buf, off)

    monkeypatch.setattr(expert_index, "_preadv", failing)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu", offload=OFFLOAD)
    assert early_loads[0] is not None and not loader_threads()


def test_a_failed_build_stops_the_loader(early_loads, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("non-expert weights failed")

    monkeypatch.setattr(build.loading, "load_non_expert_weights", broken)
    with pytest.raises(RuntimeError, match="non-expert weights failed"):
        MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu", offload=OFFLOAD)
    assert early_loads[0] is not None and not loader_threads()
    assert not early_loads[0].index._fds  # its files closed


def test_not_started_where_the_store_is_not_known_up_front(early_loads):
    MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu", offload=OffloadConfig(policy="lru", gpu_expert_slots=4,
                                                                                    background_load=True)).close()
    MoEOffloadedMixtral.from_pretrained(MODEL, device="cpu").close()  # resident
    assert early_loads == [None, None]
