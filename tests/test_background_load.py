"""``background_load``: from_pretrained returns before the experts are in host memory; they are read on demand
through the disk tier while a background fill completes, with the exact tokens of the all-resident model, and a
shard truncated during the fill fails only what needs the missing experts. ~20 s on 2 cores."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import moeflow
import moeflow.io.expert_index as expert_index
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.build import open_expert_index
from moeflow.errors import CheckpointError
from moeflow.families import family_for_config
from moeflow.io.checkpoint import CheckpointReader, read_json, read_quantization
from moeflow.offload import DiskHostStore

MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
NEW_TOKENS = 8

pytestmark = pytest.mark.usefixtures("calibration_cache")


@pytest.fixture(scope="module")
def reference():
    model = MoEOffloadedMixtral.from_pretrained(MODEL)  # every expert resident: the tokens to match
    ids = torch.tensor([model.tokenizer.encode("The \"with\" statement is used to wrap the execution")])
    return ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)


def expert_offsets(path: Path, keys) -> set[int]:
    """File offsets of the reads of ``keys`` (what the gated reader holds back)."""
    raw = read_json(path / "config.json")
    family = family_for_config(raw, "config.json")
    reader = CheckpointReader(path)
    index = open_expert_index(reader, family, family.detect_expert_layout(reader), read_quantization(path, raw))
    offsets = {offset for key in keys for _, offset, _, _ in index.experts[key].reads}
    index.close()
    return offsets


@pytest.fixture
def gated_slow_disk(monkeypatch):
    """Every range read waits 0-3 ms at random; reads of the held experts wait for ``gate`` as well."""
    rng = random.Random(0)
    real = expert_index._preadv
    state = {"held": set(), "gate": threading.Event()}

    def late(fd, buffer, offset):
        time.sleep(rng.random() * 0.003)
        if offset in state["held"]:
            state["gate"].wait(timeout=30)
        return real(fd, buffer, offset)

    monkeypatch.setattr(expert_index, "_preadv", late)
    return state


@pytest.mark.parametrize("policy,slots", [("lru", 2), ("lfu", 6)])
def test_tokens_during_the_background_fill(reference, gated_slow_disk, policy, slots):
    ids, expected = reference
    last = (3, 7)  # the fill's last expert (expert-major order over 4 layers)
    gated_slow_disk["held"] = expert_offsets(MODEL, [last])
    model = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(policy=policy, gpu_expert_slots=slots),
                                                background_load=True)
    try:
        host = model.experts.host
        assert isinstance(host, DiskHostStore) and host.capacity == 32
        assert not host.filled()  # ready before every expert is in host memory
        threading.Timer(0.3, gated_slow_disk["gate"].set).start()  # a request needing it waits until then
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out, expected)
        assert host.wait_filled(timeout=60) and len(host.resident()) == 32
        assert host.stats.fill_reads > 0 and host.stats.evictions == 0
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    finally:
        gated_slow_disk["gate"].set()
        model.close()


def test_truncated_shard_during_the_fill_fails_only_what_needs_it(reference, gated_slow_disk, tmp_path):
    ids, expected = reference
    copy = tmp_path / "m"
    copy.mkdir()
    for f in MODEL.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "model.safetensors"
    original = shard.read_bytes()
    warm = [(layer, 0) for layer in range(4)]  # the two slots' experts and a few more, read before the cut
    gated_slow_disk["held"] = expert_offsets(copy, [(layer, e) for layer in range(4) for e in range(8)
                                                    if (layer, e) not in warm])
    model = MoEOffloadedMixtral.from_pretrained(copy, offload=OffloadConfig(policy="lru", gpu_expert_slots=2),
                                                background_load=True)
    try:
        host = model.experts.host
        os.truncate(shard, 8)  # every held expert's bytes are gone
        gated_slow_disk["gate"].set()
        with pytest.raises(CheckpointError, match=str(shard).replace("\\", "\\\\")):
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert host.wait_filled(timeout=60) and host.stats.failed_reads > 0
        assert all(key in warm for key in host.resident())  # nothing half-read was kept
        shard.write_bytes(original)  # same inode, the bytes back: the failed experts are read again on demand
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    finally:
        gated_slow_disk["gate"].set()
        model.close()


def test_background_load_needs_an_offloading_placement():
    with pytest.raises(ValueError, match="offloading"):
        MoEOffloadedMixtral.from_pretrained(MODEL, background_load=True)
    with pytest.raises(ValueError, match="resident"):
        OffloadConfig(background_load=True)


def test_serve_flag_asks_for_it():
    from moeflow.cli.commands import build_parser, offload_from_args

    args = build_parser().parse_args(["serve", "--background-load", "--slots", "2", "--device", "cpu"])
    config = offload_from_args(args, args.slots, args.policy)
    assert config.background_load and config.gpu_expert_slots == 2 and config.policy == "auto"
    args = build_parser().parse_args(["serve", "--background-load", "--device", "cpu"])
    with pytest.raises(SystemExit, match="offloading placement"):
        offload_from_args(args, args.slots, args.policy)
