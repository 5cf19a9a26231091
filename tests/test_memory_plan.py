"""One memory budget (issue 20): model.memory_plan() splits the device and host budgets, slots are what is
left after weights, KV cache, activations and workspaces, "auto" budgets, refusals name the sizes, CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import main
from moeflow.engine.memory import reserved_device_bytes
from moeflow.errors import SchedulingError

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
GiB = 2**30


def _load(**config):
    return MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(**config))


def test_plan_splits_the_device_budget():
    plan = _load(policy="lru", gpu_expert_slots=4).memory_plan()
    per_slot = plan.expert_bytes
    budget = reserved_device_bytes(plan) + 7 * per_slot + per_slot // 2  # room for 7 slots, not 8
    model = _load(policy="lru", gpu_memory_gb=budget / GiB)
    plan = model.memory_plan()
    assert model.experts.n_slots == plan.expert_slots == 7
    assert plan.gpu_used == plan.non_expert + plan.kv_cache + plan.activations + plan.workspace + 7 * per_slot
    assert plan.gpu_used <= plan.gpu_budget
    assert plan.non_expert > 0 and plan.kv_cache > 0 and plan.activations > 0 and plan.workspace > 0
    text = plan.summary()
    for part in ("non-expert weights", "KV cache", "activations", "workspaces", "expert slots", "7 of 32"):
        assert part in text


def test_context_and_batch_size_the_kv_cache():
    short = _load(policy="lru", gpu_expert_slots=4, context_length=64).memory_plan()
    batch = _load(policy="lru", gpu_expert_slots=4, context_length=64, max_batch_size=4).memory_plan()
    assert short.context_length == 64 and batch.kv_cache == 4 * short.kv_cache
    assert batch.activations > short.activations and batch.workspace == 4 * short.workspace
    capped = _load(policy="lru", gpu_expert_slots=4, context_length=10**6).memory_plan()
    assert capped.context_length == 512  # the model's max_position_embeddings


def test_budget_that_cannot_fit_names_every_part():
    with pytest.raises(SchedulingError, match=r"non-expert weights .* KV cache .* \(512 tokens x 1 sequences\), "
                                              r"activations .* workspaces .* at least 2 expert slots"):
        _load(policy="lru", gpu_memory_gb=0.005)
    with pytest.raises(SchedulingError, match="or an offloading policy"):
        _load(policy="resident", gpu_memory_gb=0.011)


def test_graph_pools_are_reserved_when_the_decode_step_is_captured():
    """CUDA graphs' private pools (one per captured decode step, up to GRAPH_STEPS) come out of the device budget:
    fewer bytes for slots, a refusal that names them and the way out."""
    import torch

    from moeflow.engine import build, memory

    model = _load(policy="lru", gpu_expert_slots=4)
    family, fmt, cfg = model.family, model.experts.host.fmt, model.config
    non_expert = model.memory_plan().non_expert
    cuda = torch.device("cuda")
    offload = OffloadConfig(policy="lru", gpu_memory_gb=1.0)
    plain, _ = build.plan_memory(offload, family, fmt, cuda, torch.float16, non_expert)
    graphs, _ = build.plan_memory(offload, family, fmt, cuda, torch.float16, non_expert, cuda_graphs=True)
    assert plain.graph_pools == 0 and graphs.graph_pools >= memory.GRAPH_STEPS * memory.POOL_GRANULE
    assert reserved_device_bytes(graphs) == reserved_device_bytes(plain) + graphs.graph_pools
    assert "CUDA graph pools" in graphs.summary()
    # the estimate: steps x one step's pool rounded up to 2 MiB; more rows or a longer context never need less
    one = memory.graph_pool_bytes(cfg, torch.float16, 512, 1, 2, cfg.intermediate_size, steps=1)
    assert one % memory.POOL_GRANULE == 0 and memory.graph_pool_bytes(
        cfg, torch.float16, 512, 1, 2, cfg.intermediate_size) == memory.GRAPH_STEPS * one
    big = memory.graph_pool_bytes(cfg, torch.float16, 10**6, 64, 2, cfg.intermediate_size, steps=1)
    assert big > one and memory.graph_pool_bytes(cfg, torch.float16, 512, 1, 2, 64, steps=0) == 0
    # a budget with room for the minimum slots beside everything but the pools is refused, naming them
    tight = (reserved_device_bytes(plain) + 2 * plain.expert_bytes + 1024) / GiB
    build.plan_memory(OffloadConfig(policy="lru", gpu_memory_gb=tight), family, fmt, cuda, torch.float16,
                      non_expert)
    with pytest.raises(SchedulingError, match=r"CUDA graph pools .* \(or cuda_graphs=False\)"):
        build.plan_memory(OffloadConfig(policy="lru", gpu_memory_gb=tight), family, fmt, cuda, torch.float16,
                          non_expert, cuda_graphs=True)


def test_auto_budgets_take_free_memory():
    model = _load(policy="lru", gpu_memory_gb="auto", host_memory_gb="auto")
    plan = model.memory_plan()
    assert plan.gpu_budget > 0 and plan.host_budget > 0
    assert plan.expert_slots == 32 and plan.host_experts == 32  # this machine holds the tiny model


def test_host_side_of_the_plan_with_the_disk_tier():
    base = _load(policy="lru", gpu_expert_slots=4).memory_plan()
    # weights + KV (CPU device) + two staging buffers + 8 expert rows
    staging = 2 * 51136  # tiny-mixtral-awq: the largest expert read (+64 B alignment)
    budget = base.non_expert + base.kv_cache + staging + 8 * base.expert_bytes + base.expert_bytes // 2
    model = _load(policy="lru", gpu_expert_slots=4, host_memory_gb=budget / GiB)
    plan = model.memory_plan()
    assert plan.host_experts == model.experts.host.capacity == 8
    assert plan.staging == model.experts.host.staging_nbytes == staging
    assert plan.host_used <= plan.host_budget
    assert "24 read from disk" in plan.summary()


def test_cli_takes_the_budgets_and_prints_the_plan(capsys):
    # a host budget short of the experts (1.37 MiB of weights + KV with the CPU default int8 attention, 32 x 49 KiB)
    assert main(["demo", "--host-memory-gb", "0.0024", "--gpu-memory-gb", "0.05", "--max-new-tokens", "4",
                 "--no-warmup", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert "memory plan" in out and "read from disk" in out and "disk tier:" in out
    with pytest.raises(SystemExit):
        main(["demo", "--host-memory-gb", "lots"])


def test_disk_traffic_is_in_the_model_stats():
    """model.stats.summary() (what the README prints) reports the disk tier's reads and host-tier hits; reset()
    zeroes them with the rest (model.stats.disk is the store's own counters)."""
    base = _load(policy="lru", gpu_expert_slots=4).memory_plan()
    budget = base.non_expert + base.kv_cache + 2 * 51136 + 8 * base.expert_bytes + base.expert_bytes // 2
    model = _load(policy="lru", gpu_expert_slots=4, host_memory_gb=budget / GiB)
    try:
        disk = model.stats.disk
        assert disk is model.experts.host.stats
        model.stats.reset()
        assert disk.bytes_read == disk.reads == disk.hits == 0
        ids = model.tokenizer("The import statement")["input_ids"]
        model.generate(ids, max_new_tokens=4, do_sample=False)
        assert disk.reads > 0 and disk.bytes_read > 0 and disk.hits + disk.misses > 0
        assert (f"disk tier: {disk.bytes_read / 2**20:.1f} MiB read ({disk.reads} experts" in model.stats.summary()
                and f"host tier hits {disk.hits} / misses {disk.misses}" in model.stats.summary())
        assert model.stats.as_dict()["disk"]["reads"] == disk.reads
    finally:
        model.close()
    assert "disk tier" not in _load(policy="lru", gpu_expert_slots=4).stats.summary()
