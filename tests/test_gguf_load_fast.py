"""The GGUF load's fast paths against what they replace, bit for bit.

* Q4_0 experts into the AWQ format by moving packed words (kernels/repack.q4_0_to_awq, cpu/repack.c's
  mf_q4_0_to_awq, and its plain-torch twin) against the unpacking reference (io/gguf/experts.
  q4_0_awq_expert_tensors_reference): random blocks holding every nibble value, scales of every sign, subnormals
  and odd mantissas; row counts that leave the AVX-512 loop a tail; the portable C build.
* The metadata parse (io/gguf/files._open: gguf-py's reader slicing plain ndarrays, arrays of scalars and strings
  walked in one loop) against gguf-py's own reader, field by field; a file cut inside an array is named.

~4 s on 2 cores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow.engine import gguf_experts
from moeflow.errors import CheckpointError
from moeflow.io.gguf.experts import ExpertBytes, ExpertSlice, q4_0_awq_expert_tensors_reference
from moeflow.io.gguf.files import _open
from moeflow.kernels import repack
from moeflow.kernels.cpu import native as cpu_native
from moeflow.quant.ggml import ggml_type

Q4_0 = ggml_type(2)
# (intermediate I, hidden H): gate/up [I, H], down [H, I]; 4 to 32 8-row groups per matrix (20: one 16-group
# AVX-512 step and a tail of 4); K from one Q4_0 block up
SHAPES = [(32, 32), (160, 64), (128, 96), (64, 256)]


def q4_0_rows(n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, k/32 * 18]: random Q4_0 blocks; the codes cycle through all 16 values in every position, the scales
    are random fp16 bit patterns (both signs, subnormals, odd mantissas; no inf/nan)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // 32, 18), generator=g, dtype=torch.uint8)
    m = min(16, blocks.shape[0])  # byte p of block j: nibbles (j + p) % 16 twice, so 16 blocks hold every value
    blocks[:m, 2:] = ((torch.arange(m).view(-1, 1) + torch.arange(16)) % 16 * 17).to(torch.uint8)  # everywhere
    d = blocks[:, :2].contiguous().view(torch.int16)
    finite = (d.view(torch.float16).isfinite()).view(-1, 1)
    blocks[:, :2] = torch.where(finite, blocks[:, :2], torch.tensor([0x01, 0xBC], dtype=torch.uint8))
    return blocks.view(n, -1)


def expert_of(i: int, h: int, seed: int) -> tuple[ExpertBytes, dict[str, torch.Tensor]]:
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    raw = {p: q4_0_rows(*s, seed + j) for j, (p, s) in enumerate(shapes.items())}
    slices = {p: ExpertSlice(Path("x.gguf"), 0, raw[p].numel(), Q4_0, s, f"blk.0.ffn_{p}_exps.weight")
              for p, s in shapes.items()}
    return ExpertBytes(**slices), raw


@pytest.fixture(params=["native", "torch"])
def lib(request):
    """moeflow's CPU library (the C converter), or None (the plain-torch twin)."""
    if request.param == "torch":
        return None
    if not cpu_native.native_available():
        pytest.skip("moeflow's CPU library does not build here")
    return cpu_native.library()


@pytest.mark.parametrize("i,h", SHAPES)
def test_expert_tensors_equal_the_unpacking_reference(monkeypatch, lib, i, h):
    monkeypatch.setattr(gguf_experts, "library", lambda: lib)
    expert, raw = expert_of(i, h, i + h)
    got = gguf_experts.q4_0_awq_expert_tensors(expert, raw)
    ref = q4_0_awq_expert_tensors_reference(expert, raw)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int16) if t.dtype == torch.float16 else got[name],
                           t.view(torch.int16) if t.dtype == torch.float16 else t), name


def test_portable_c_build_gives_the_same_bytes(monkeypatch, tmp_path):
    """The scalar C loop (no AVX-512 at the baseline ISA) against the reference."""
    portable = cpu_native.load(cpu_native.build(tmp_path, native_arch=False))
    monkeypatch.setattr(gguf_experts, "library", lambda: portable)
    expert, raw = expert_of(160, 96, 5)
    got = gguf_experts.q4_0_awq_expert_tensors(expert, raw)
    for name, t in q4_0_awq_expert_tensors_reference(expert, raw).items():
        assert torch.equal(got[name].view(t.shape).flatten().view(torch.uint8), t.flatten().view(torch.uint8)), name


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="N % 8"):
        repack.q4_0_to_awq(q4_0_rows(8, 32, 0)[:4], torch.empty(32, 1, dtype=torch.int32),
                           torch.empty(1, 4, dtype=torch.float16))
    expert, raw = expert_of(32, 32, 0)
    bad = ExpertSlice(Path("m.gguf"), 0, 0, ggml_type(8), (32, 32), "blk.0.ffn_up_exps.weight")
    with pytest.raises(ValueError, match="m.gguf: blk.0.ffn_up_exps.weight: Q8_0, not Q4_0"):
        gguf_experts.q4_0_awq_expert_tensors(ExpertBytes(expert.gate, bad, expert.down), raw)


def test_metadata_parse_equals_gguf_py_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_rope_freq_base(1e6)
    w.add_token_list([b"<unk>", "\u2581h\u00e9".encode(), b""] + [f"t{i}".encode() for i in range(300)])
    w.add_token_scores([float(-i) for i in range(303)])
    w.add_token_types([2] + [1] * 302)
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b", np.ones((4, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got, ref = _open(path), gguf.GGUFReader(path)
    assert list(got.fields) == list(ref.fields) and len(got.fields["tokenizer.ggml.tokens"].data) == 303
    for name, f in ref.fields.items():
        g = got.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), name
        assert len(g.parts) == len(f.parts) and all(a.dtype == b.dtype and np.array_equal(a, b)
                                                    for a, b in zip(g.parts, f.parts, strict=True)), name
    assert [(t.name, t.tensor_type, t.data_offset, list(t.shape)) for t in got.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, list(t.shape)) for t in ref.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(got.tensors, ref.tensors, strict=True))
    for field in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores"):  # cut inside an array: the file named
        cut = tmp_path / f"cut-{field}.gguf"
        cut.write_bytes(path.read_bytes()[: ref.fields[field].offset + 200])
        with pytest.raises(CheckpointError, match=f"cannot read GGUF file {cut}"):
            _open(cut)
