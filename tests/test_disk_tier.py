"""The disk tier (issue 20): with only a quarter of the experts in host memory, every policy generates exactly
the tokens it generates with every expert in host memory (the all-resident tokens, for the exact policies),
with the sync and random-delay transports and a disk that answers late; loading reads no more than the
non-expert weights and the warm fill; bad budgets and damaged files fail with clear errors."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch

import moeflow
import moeflow.io.expert_index as expert_index
from moeflow import MoEModel, MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.build import open_expert_index
from moeflow.engine.loading import non_expert_bytes
from moeflow.engine.memory import kv_cache_bytes
from moeflow.errors import CheckpointError, SchedulingError
from moeflow.families import family_for_config
from moeflow.io.checkpoint import CheckpointReader, read_json, read_quantization
from moeflow.kernels.cpu.int4 import int4_cpu_available
from moeflow.offload import DiskHostStore
from moeflow.offload.cpu_slots import CpuInt4Format

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"  # 4 layers x 8 experts, predictors shipped
NEW_TOKENS = 8
EXACT_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "duoserve", "promoe", "finemoe", "auto",
                  "expertflow")
READERS = 2


pytestmark = pytest.mark.usefixtures("calibration_cache")


def host_budget_gb(path: Path, rows: int, dtype=torch.float32, kernels: str = "auto") -> float:
    """host_memory_gb that holds exactly ``rows`` experts next to the non-expert weights, KV cache and staging, for
    a model loaded with ``kernels`` (their non-expert weights differ: the CPU int4 path's int8 linears)."""
    reader, family, layout, quant = _reader_family_layout_quant(path)
    index = open_expert_index(reader, family, layout, quant)
    index.close()
    resident = MoEModel.from_pretrained(path, kernels=kernels)  # (int8 lm_head on the CPU int4 path); any family
    reserved = non_expert_bytes(resident.model) + kv_cache_bytes(family.config, dtype, 4096)
    row = resident.experts.fmt.nbytes
    if resident.kernels == "cpu-int4" and resident.experts.fmt.cpu_int4:  # offloaded plain AWQ experts on the CPU:
        # torch's int4 form (moeflow.offload.cpu_slots); MXFP4 / GGUF experts keep their bytes (their own kernels)
        row = CpuInt4Format.of(resident.experts.fmt).nbytes
    return (reserved + READERS * index.staging_nbytes + rows * row + row // 2) / 2**30


@pytest.fixture(scope="module")
def reference():
    model = MoEOffloadedMixtral.from_pretrained(MODEL)  # resident CPU int4: _run's kernels and bytes
    ids = torch.tensor([model.tokenizer.encode("The \"with\" statement is used to wrap the execution")])
    total = model.config.num_hidden_layers * model.config.num_local_experts
    return ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), total, \
        host_budget_gb(MODEL, total // 4)


@pytest.fixture
def slow_disk(monkeypatch):
    """Every range read waits 0-2 ms at random (from several reader threads: reads finish out of order)."""
    rng = random.Random(0)
    real = expert_index._preadv

    def late(fd, buffer, offset):
        time.sleep(rng.random() * 0.002)
        return real(fd, buffer, offset)

    monkeypatch.setattr(expert_index, "_preadv", late)


def _run(ids, **config):
    model = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(disk_readers=READERS, **config))
    try:
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), model
    finally:
        model.close()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", EXACT_POLICIES)
def test_quarter_of_the_experts_on_the_host_keeps_the_tokens(reference, slow_disk, policy, transport):
    ids, expected, total, budget = reference
    prefetch_reads = 0
    for n_slots in (2, 6, total):
        out, model = _run(ids, policy=policy, gpu_expert_slots=n_slots, host_memory_gb=budget, transport=transport,
                          random_delay_ms=0.3, seed=n_slots)
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots and {total // 4} host rows"
        host = model.experts.host
        assert isinstance(host, DiskHostStore) and host.capacity == total // 4
        if n_slots < total:  # the rest came from disk
            assert host.stats.bytes_read > host.stats.load_bytes_read and host.stats.misses > 0
        prefetch_reads += host.stats.prefetch_reads
    if policy not in ("ondemand", "lru", "lfu", "static"):  # guesses are read from disk ahead of their layer
        assert prefetch_reads > 0


@pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
@pytest.mark.parametrize("transport", ["sync", "random-delay"])
def test_hybrid_policy_with_the_disk_tier_matches_it_without(reference, slow_disk, transport):
    """fiddler computes misses with the CPU int4 kernels (not bitwise the GPU result): same tokens as fiddler
    with every expert in host memory."""
    ids, _, total, budget = reference
    for n_slots in (2, 6):
        want, _ = _run(ids, policy="fiddler", gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3)
        got, model = _run(ids, policy="fiddler", gpu_expert_slots=n_slots, host_memory_gb=budget,
                          transport=transport, random_delay_ms=0.3)
        assert torch.equal(got, want), f"fiddler/{transport} with {n_slots} slots"
        assert model.stats.decode.cpu_experts > 0


def test_load_reads_only_non_expert_weights_and_the_warm_fill(reference, monkeypatch):
    ids, expected, total, budget = reference
    got_bytes = []
    real_get = CheckpointReader.get

    def counting_get(self, name, shape=None):
        t = real_get(self, name, shape)
        if type(self) is CheckpointReader:  # the expert index's readers serve its preads and meta tensors
            got_bytes.append(t.numel() * t.element_size())
        return t

    preads = []
    real_pread = expert_index._preadv

    def counting_pread(fd, buffer, offset):
        n = real_pread(fd, buffer, offset)
        preads.append(n)
        return n

    monkeypatch.setattr(CheckpointReader, "get", counting_get)
    monkeypatch.setattr(expert_index, "_preadv", counting_pread)
    model = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(
        policy="lru", gpu_expert_slots=4, host_memory_gb=budget, disk_readers=READERS))
    try:
        host = model.experts.host
        file_bytes = os.path.getsize(MODEL / "model.safetensors")
        expert_disk = host.source.expert_bytes // total  # every expert has the same size here
        loaded = sum(got_bytes) + sum(preads)
        non_expert = sum(loc.end - loc.start for name, loc in host.source.locations.items() if ".experts." not in name)
        warm = host.capacity * expert_disk
        assert sum(preads) == host.stats.load_bytes_read == warm  # the warm fill, nothing else, through preads
        # safetensors reads: the non-expert weights plus one AWQ scales tensor (expert layout detection)
        assert non_expert <= sum(got_bytes) <= non_expert + expert_disk
        assert loaded <= non_expert + warm + expert_disk < file_bytes * 0.5
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out, expected)
    finally:
        model.close()


def test_host_budget_below_the_minimum_names_the_sizes(reference):
    _, _, total, _ = reference
    small = host_budget_gb(MODEL, 1)
    with pytest.raises(SchedulingError, match=r"leaves room for 1 experts after .* non-expert weights and .* "
                                              r"staging buffers; the minimum is 2 experts"):
        MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(
            policy="lru", gpu_expert_slots=4, host_memory_gb=small, disk_readers=READERS))
    with pytest.raises(ValueError, match="host_memory_gb"):
        OffloadConfig(host_memory_gb=0)
    with pytest.raises(ValueError, match="'auto'"):
        OffloadConfig(host_memory_gb="all")


def test_every_expert_fits_loads_without_the_disk_tier(reference):
    ids, expected, total, _ = reference
    out, model = _run(ids, policy="lru", gpu_expert_slots=4, host_memory_gb=host_budget_gb(MODEL, total + 1))
    assert torch.equal(out, expected)
    assert not model.experts.host.on_disk


def test_auto_host_budget(reference):
    ids, expected, _, _ = reference
    out, model = _run(ids, policy="lru", gpu_expert_slots=4, host_memory_gb="auto")
    assert torch.equal(out, expected)  # this machine holds the tiny model: no disk tier needed


def test_truncated_shard_after_load_fails_clearly(reference, tmp_path):
    ids, _, total, budget = reference
    copy = tmp_path / "m"
    copy.mkdir()
    for f in MODEL.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    model = MoEOffloadedMixtral.from_pretrained(copy, offload=OffloadConfig(
        policy="lru", gpu_expert_slots=2, host_memory_gb=budget, disk_readers=READERS))
    try:
        os.truncate(copy / "model.safetensors", os.path.getsize(copy / "model.safetensors") // 2)
        with pytest.raises(CheckpointError, match="shorter than when it was loaded"):
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        host = model.experts.host
        assert host.stats.failed_reads > 0
        # nothing half-read is in host memory: every row marked ready holds exactly its expert's bytes
        intact = open_expert_index(*_reader_family_layout_quant(MODEL))
        staging = intact.new_staging()
        assert host.resident()
        for key in host.resident():
            want = torch.zeros(host.fmt.nbytes, dtype=torch.uint8)
            host.fmt.write(want, intact.read(*key, staging))
            assert torch.equal(host.buffer[host.index(*key)], want), key
        intact.close()
    finally:
        model.close()


def _reader_family_layout_quant(path: Path):
    raw = read_json(path / "config.json")
    family = family_for_config(raw, "config.json")
    reader = CheckpointReader(path)
    return reader, family, family.detect_expert_layout(reader), read_quantization(path, raw)


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
def test_sharded_checkpoint_with_a_quarter_on_the_host(tmp_path, slow_disk, transport):
    """A checkpoint in many shards (experts split across files): the same tokens as with every expert resident."""
    from helpers import make_tiny_model

    path = tmp_path / "sharded"
    make_tiny_model(seed=12, num_hidden_layers=2, num_local_experts=8).save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 3
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = MoEOffloadedMixtral.from_pretrained(path).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    budget = host_budget_gb(path, 4)
    for slots in (2, 5):
        model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(
            policy="lfu", gpu_expert_slots=slots, host_memory_gb=budget, disk_readers=READERS, transport=transport,
            random_delay_ms=0.3))
        try:
            assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
            assert model.experts.host.capacity == 4 and model.experts.host.stats.misses > 0
        finally:
            model.close()
