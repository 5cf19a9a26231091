"""The checkpoint index of expert byte ranges (moeflow/io/expert_index.py): every layout and tensor order reads
back exactly what the family's reader gives, with a few preads, and a damaged shard fails loudly."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model
from safetensors.torch import load_file, save_file

from moeflow.errors import CheckpointError
from moeflow.families import family_for_config
from moeflow.io.checkpoint import CheckpointReader, read_json, read_quantization
from moeflow.io.expert_index import ExpertIndex

AWQ_DIR = Path(__file__).resolve().parents[1] / "moeflow" / "data" / "tiny-mixtral-awq"
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.int32: "I32", torch.bfloat16: "BF16"}


def open_index(directory: Path, **kwargs) -> tuple[ExpertIndex, CheckpointReader, callable]:
    raw = read_json(directory / "config.json")
    family = family_for_config(raw, "config.json")
    quant = read_quantization(directory, raw)
    reader = CheckpointReader(directory)
    layout = family.detect_expert_layout(reader)

    def read(r, layer, expert):
        return family.read_expert(r, layout, quant, layer, expert)

    index = ExpertIndex(reader, read, len(family.moe_layers), family.num_experts, **kwargs)
    return index, reader, read


def assert_same_as_family(directory: Path) -> ExpertIndex:
    index, reader, read = open_index(directory)
    staging = index.new_staging()
    for layer, expert in index.experts:
        got, want = index.read(layer, expert, staging), read(reader, layer, expert)
        assert got.keys() == want.keys()
        for name in got:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (layer, expert, name)
    assert index.bytes_read == sum(index.nbytes(*k) for k in index.experts)
    return index


def write_safetensors_in_order(tensors: dict[str, torch.Tensor], path: Path, order: list[str]) -> None:
    """A valid safetensors file whose data lies in ``order`` (save_file always sorts)."""
    header, at, blobs = {}, 0, []
    for name in order:
        t = tensors[name].contiguous()
        raw = t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_sharded_classic_checkpoint(tmp_path):
    make_tiny_model(seed=1).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    index = assert_same_as_family(tmp_path)
    # one expert is three tensors (w1, w2, w3): at most three reads, and no more bytes than the tensors
    plan = index.experts[(1, 3)]
    assert 1 <= len(plan.reads) <= 3
    assert index.nbytes(1, 3) <= 3 * 64 * 64 * 4 + 2 * 64 * 2**10


def test_awq_checkpoint_reads_few_ranges():
    index = assert_same_as_family(AWQ_DIR)
    assert all(len(p.reads) <= 3 for p in index.experts.values())
    # nothing close to the whole file per expert: the bytes of one expert's nine tensors
    assert index.nbytes(0, 0) < os.path.getsize(AWQ_DIR / "model.safetensors") / 16


def test_joined_tensors_reuse_the_reading_buffers_arena():
    """The w13 tensors a read joins from gate and up live in the staging buffer's arena, the same bytes read after
    read (no fresh allocation per expert), and equal the family's own read; outside a read, concat allocates."""
    from moeflow.families.gated_experts import concat

    index, reader, read = open_index(AWQ_DIR)
    staging = index.new_staging()
    ptrs = set()
    for key in [(0, 0), (0, 1), (1, 3)]:
        got, want = index.read(*key, staging), read(reader, *key)
        for name in got:
            assert torch.equal(got[name], want[name]), (key, name)
        ptrs.add(got["w13_qweight"].data_ptr())
        assert got["w13_qweight"].untyped_storage().data_ptr() != staging.untyped_storage().data_ptr()
    assert len(ptrs) == 1, "each read joined w13 into a fresh allocation"
    a, b = torch.ones(2, 3), torch.zeros(2, 1)
    joined = concat([a, b], dim=1)
    assert torch.equal(joined, torch.cat([a, b], dim=1)) and joined.data_ptr() not in ptrs


def test_fused_layout_reads_one_row_of_each_stacked_tensor(tmp_path):
    classic = tmp_path / "classic"
    make_tiny_model(seed=2).save_pretrained(classic)
    sd = load_file(classic / "model.safetensors")
    fused_sd = {n.replace(".block_sparse_moe.", ".mlp."): t for n, t in sd.items() if ".experts." not in n}
    for layer in range(2):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        fused_sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{base}.{e}.w1.weight"], sd[f"{base}.{e}.w3.weight"]]) for e in range(6)])
        fused_sd[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [sd[f"{base}.{e}.w2.weight"] for e in range(6)])
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((classic / "config.json").read_text())
    save_file(fused_sd, fused / "model.safetensors")
    index = assert_same_as_family(fused)
    one_expert = (2 * 64 * 64 + 64 * 64) * 4
    assert index.nbytes(1, 4) == one_expert  # the expert's rows only, not the [E, ...] tensors


def test_any_tensor_order(tmp_path):
    classic = tmp_path / "classic"
    make_tiny_model(seed=3).save_pretrained(classic)
    sd = load_file(classic / "model.safetensors")
    order = list(sd)
    random.Random(0).shuffle(order)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    (shuffled / "config.json").write_text((classic / "config.json").read_text())
    write_safetensors_in_order(sd, shuffled / "model.safetensors", order)
    assert_same_as_family(shuffled)


def test_truncated_shard_fails_the_read(tmp_path):
    make_tiny_model(seed=4).save_pretrained(tmp_path)
    index, _, _ = open_index(tmp_path)
    staging = index.new_staging()
    index.read(0, 0, staging)  # opens the file
    path, offset, length, _ = index.experts[(1, 5)].reads[-1]
    os.truncate(path, offset + length // 2)
    with pytest.raises(CheckpointError, match="shorter than when it was loaded"):
        index.read(1, 5, staging)


def test_deleted_shard_fails_the_read(tmp_path):
    make_tiny_model(seed=5).save_pretrained(tmp_path, max_shard_size="40KB")
    index, _, _ = open_index(tmp_path)
    staging = index.new_staging()
    for key in index.experts:  # every shard opened while it existed
        index.read(*key, staging)
    path = index.experts[(1, 2)].reads[0][0]
    os.remove(path)
    with pytest.raises(CheckpointError, match="deleted after the model was loaded"):
        index.read(1, 2, staging)


def test_failing_range_read_returns_nothing(tmp_path):
    make_tiny_model(seed=6).save_pretrained(tmp_path)
    calls = []

    def flaky(fd, buffer, offset):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return os.preadv(fd, [buffer[:1000]], offset)  # a short first read, then the device fails

    index, _, _ = open_index(tmp_path, range_reader=flaky)
    with pytest.raises(CheckpointError, match="Input/output error"):
        index.read(0, 0, index.new_staging())
    assert index.bytes_read == 0


def test_short_reads_are_continued(tmp_path):
    make_tiny_model(seed=7).save_pretrained(tmp_path)

    def dribble(fd, buffer, offset):  # the kernel may return fewer bytes than asked
        return os.preadv(fd, [buffer[:1000]], offset)

    index, reader, read = open_index(tmp_path, range_reader=dribble)
    got = index.read(1, 1, index.new_staging())
    want = read(reader, 1, 1)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_not_a_safetensors_file(tmp_path):
    make_tiny_model(seed=8).save_pretrained(tmp_path)
    reader = CheckpointReader(tmp_path)
    name = reader.names()[0]
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="not a safetensors file"):  # (headers are read when first needed)
        ExpertIndex(reader, lambda r, a, b: {"t": r.get(name)}, 1, 1)
