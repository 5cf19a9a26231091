"""Bad GGUF input gives a clear error naming the file: truncated, not GGUF, an unknown or dense architecture, an
unsupported ggml type (named, with the supported ones), a split set with a part missing, an ambiguous directory.
~10 s on 2 cores (19 s with pytest's start-up)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from family_models import make_family_model  # noqa: E402
from gguf_models import T, write_gguf  # noqa: E402

from moeflow import MoEModel  # noqa: E402
from moeflow.errors import CheckpointError, UnsupportedQuantizationError  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return make_family_model("qwen3_moe", seed=1, norm_topk_prob=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))


def test_truncated_file_names_the_file(tmp_path, model):
    path = tmp_path / "m.gguf"
    write_gguf(model, path)
    size = path.stat().st_size
    os.truncate(path, size - 100)  # inside the last tensor's data
    with pytest.raises(CheckpointError, match=rf"cannot read GGUF file {path} \({size - 100} bytes; truncated"):
        MoEModel.from_pretrained(path)
    os.truncate(path, 40)  # inside the metadata
    with pytest.raises(CheckpointError, match=rf"cannot read GGUF file {path} \(40 bytes; truncated or not a GGUF"):
        MoEModel.from_pretrained(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(CheckpointError, match=rf"cannot read GGUF file {path}"):
        open_gguf(path)


def _write_arch(path, arch: str, experts: int | None) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    if experts:
        w.add_expert_count(experts)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "g.gguf"
    _write_arch(path, "gemma2", None)
    with pytest.raises(CheckpointError, match=rf"{path}: GGUF architecture 'gemma2' is not supported; moeflow reads "
                                              r"GGUF files of architecture deepseek2, glm4moe, gpt-oss, llama, "
                                              r"minimax-m2, olmoe, qwen2moe, qwen3moe"):
        MoEModel.from_pretrained(path)


def test_dense_llama_is_refused(tmp_path):
    path = tmp_path / "l.gguf"
    _write_arch(path, "llama", None)
    with pytest.raises(CheckpointError, match=rf"{path}: GGUF architecture 'llama' without llama.expert_count is a "
                                              "dense model"):
        open_gguf(path)


def test_unsupported_expert_type_names_it_and_the_supported_types(tmp_path, model):
    path = tmp_path / "iq4.gguf"
    rng = np.random.default_rng(0)
    raw = {}
    for p, out, inp in (("gate", 32, 64), ("up", 32, 64), ("down", 64, 32)):
        blocks = rng.integers(0, 256, (8 * out * inp // 32, 18), dtype=np.uint8)
        blocks[:, :2] = np.full((len(blocks), 1), 0.01, dtype=np.float16).view(np.uint8)  # a finite scale
        raw[(0, p)] = (blocks.reshape(8, out, -1), T.IQ4_NL)
    write_gguf(model, path, raw_experts=raw)
    with pytest.raises(UnsupportedQuantizationError) as e:
        MoEModel.from_pretrained(path)
    msg = str(e.value)
    assert str(path) in msg and "blk.0.ffn_gate_exps.weight" in msg and "GGML type IQ4_NL is not supported" in msg
    assert "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4" in msg


def test_split_set_with_a_part_missing_names_it(tmp_path, model):
    first = tmp_path / "s-00001-of-00003.gguf"
    write_gguf(model, first, split=3)
    missing = tmp_path / "s-00002-of-00003.gguf"
    missing.unlink()
    with pytest.raises(CheckpointError, match=rf"{first}: the split GGUF set has 3 parts but {missing} is missing"):
        MoEModel.from_pretrained(tmp_path)


def test_directory_with_two_models_asks_for_gguf_file(tmp_path, model):
    write_gguf(model, tmp_path / "a.gguf", expert_types=T.Q8_0)
    write_gguf(model, tmp_path / "b.gguf", expert_types=T.Q4_0)
    with pytest.raises(CheckpointError, match=r"holds several GGUF models \(a.gguf, b.gguf\): pass gguf_file="):
        MoEModel.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"gguf_file='c.gguf': no such file in"):
        MoEModel.from_pretrained(tmp_path, gguf_file="c.gguf")
    a = MoEModel.from_pretrained(tmp_path, gguf_file="a.gguf", dtype=torch.float32)
    b = MoEModel.from_pretrained(tmp_path / "b.gguf", dtype=torch.float32)
    x = torch.arange(10).view(1, 10)
    assert not torch.equal(a(x).logits, b(x).logits)  # Q8_0 and Q4_0 experts: two different models were read
    a.close()
    b.close()


def test_hub_id_offline_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"'someone/model-GGUF' / gguf_file='m-Q4_K_M.gguf'.*offline mode: 1"):
        MoEModel.from_pretrained("someone/model-GGUF", gguf_file="m-Q4_K_M.gguf")
