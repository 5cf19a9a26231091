"""``from_pretrained`` without an OffloadConfig: every expert on the device when they fit (always on the CPU),
else offloaded with ``policy="auto"`` and slots sized from the free memory, with a warning that says so."""

from __future__ import annotations

import logging

import pytest
import torch

from moeflow import MoEModel, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.engine import build, loading, memory


@pytest.fixture(scope="module")
def model():
    m = MoEModel.from_pretrained(embedded_model_path(), kernels="torch")
    yield m
    m.close()


def test_the_cpu_keeps_every_expert_resident(model):
    assert model.offload == OffloadConfig() and model.offload.policy == "resident"
    assert getattr(model.experts, "n_slots", None) is None  # the resident backend, no slot pool


def _choice(model, free_bytes: int, monkeypatch, caplog, cuda_graphs: bool = False) -> OffloadConfig:
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: free_bytes)
    with caplog.at_level(logging.WARNING, logger="moeflow.engine.build"):
        choice, planned = build.default_offload(model.family, model.experts.fmt, torch.device("cuda"),
                                                torch.float16, loading.non_expert_bytes(model.model), "tiny",
                                                cuda_graphs)
    # the offloading choice comes with its plan (the budget read once), the resident one without
    assert (planned is None) == (choice.policy == "resident")
    if planned is not None:
        assert planned[0].gpu_budget > 0 and planned[1].gpu_memory_gb == planned[0].gpu_budget / memory.GiB
        assert (planned[0].graph_pools > 0) == cuda_graphs
    return choice


def test_a_device_that_holds_everything_keeps_it_resident(model, monkeypatch, caplog):
    assert _choice(model, 8 * memory.GiB, monkeypatch, caplog) == OffloadConfig()
    assert not caplog.records


def test_a_device_too_small_offloads_with_auto_and_says_so(model, monkeypatch, caplog):
    fmt = model.experts.fmt
    total = len(model.family.moe_layers) * model.family.num_experts * fmt.nbytes
    plan, _ = build.plan_memory(OffloadConfig(policy="auto", gpu_memory_gb=1.0), model.family, fmt,
                                torch.device("cuda"), torch.float16, loading.non_expert_bytes(model.model))
    rest = memory.reserved_device_bytes(plan)
    # free memory for the rest plus half the experts, before the auto budget's margin (512 MiB at least)
    free = rest + total // 2 + memory.GPU_AUTO_MIN_MARGIN
    got = _choice(model, free, monkeypatch, caplog)
    assert got == OffloadConfig(policy="auto", gpu_memory_gb="auto")
    assert "do not fit" in caplog.text and "offload=OffloadConfig" in caplog.text


def test_a_device_too_small_even_to_offload_is_refused_naming_the_parts(model, monkeypatch, caplog):
    from moeflow.errors import SchedulingError

    with pytest.raises(SchedulingError, match="KV cache"):
        _choice(model, memory.GPU_AUTO_MIN_MARGIN + 1024, monkeypatch, caplog)


def test_graph_pools_count_against_keeping_every_expert_resident(model, monkeypatch, caplog):
    """Free memory that holds every expert beside the rest, but not beside the captured decode steps' pools too:
    resident without CUDA graphs, offloaded with them."""
    fmt = model.experts.fmt
    total = len(model.family.moe_layers) * model.family.num_experts * fmt.nbytes
    plan, _ = build.plan_memory(OffloadConfig(policy="auto", gpu_memory_gb=1.0), model.family, fmt,
                                torch.device("cuda"), torch.float16, loading.non_expert_bytes(model.model))
    pools = build.plan_memory(OffloadConfig(policy="auto", gpu_memory_gb=1.0), model.family, fmt,
                              torch.device("cuda"), torch.float16, loading.non_expert_bytes(model.model),
                              cuda_graphs=True)[0].graph_pools
    assert pools > total  # (the tiny model's experts take 1.6 MiB, the pools 16 x 2 MiB)
    free = memory.reserved_device_bytes(plan) + pools + total // 2 + memory.GPU_AUTO_MIN_MARGIN
    assert _choice(model, free, monkeypatch, caplog) == OffloadConfig()
    assert _choice(model, free, monkeypatch, caplog, cuda_graphs=True) == OffloadConfig(policy="auto",
                                                                                       gpu_memory_gb="auto")
