"""An all-Q4_0 GGUF's resident CPU experts loaded straight into the CPU int4 form (engine/gguf_experts.
DirectQ4_0Load, cpu/repack.c's mf_q4_0_to_q4z), against the AWQ route it replaces, bit for bit:

* ``q4_0_to_q4z`` against ``Q4Matrix.from_q4_0`` of the unpacked codes (row counts with an 8-row tail, row ranges
  as threads split a matrix; the -march=native and the portable C builds);
* one expert against ``Int4Expert.from_awq_tensors`` of the unpacking reference's AWQ tensors;
* a tiny Q4_0 GGUF loaded with ``mmap=True`` and ``mmap=False``: every expert's form and the greedy tokens equal
  the AWQ route's (the direct path switched off);
* a file cut short after its header was read, and a read that fails: a CheckpointError naming the file, from
  ``from_pretrained``, for both reads.

~15 s on 2 cores."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_tiny_model
from test_gguf_load_fast import expert_of, q4_0_rows

from moeflow import MoEModel
from moeflow.engine import build, gguf_experts
from moeflow.errors import CheckpointError
from moeflow.io.gguf.experts import q4_0_awq_expert_tensors_reference
from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.q4_matrix import Q4_F16Z8, Q4Matrix
from moeflow.kernels.repack import q4_0_to_q4z
from moeflow.moe import CpuInt4Experts
from moeflow.quant.ggml import q4_0_codes

pytestmark = pytest.mark.skipif(not cpu_native.native_available(),
                                reason="moeflow's CPU kernels do not build here (no compiler)")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_matrix(a, b) -> bool:
    return a.group_size == b.group_size and a.fmt == b.fmt and all(
        _same(getattr(a, t).contiguous(), getattr(b, t).contiguous()) for t in ("packed", "scales", "mins"))


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request, tmp_path_factory):
    if request.param == "native":
        return cpu_native.library()
    return cpu_native.load(cpu_native.build(tmp_path_factory.mktemp("portable"), native_arch=False))


@pytest.mark.parametrize("n,k", [(8, 32), (24, 64), (13, 96), (5, 32), (136, 256)])
def test_q4_0_to_q4z_equals_the_unpacked_codes(lib, n, k):
    raw = q4_0_rows(n, k, n + k)
    ref = Q4Matrix.from_q4_0(*q4_0_codes(raw))
    packed = torch.full((n, k // 2), 0xAA, dtype=torch.uint8)
    scales = torch.zeros(n, k // 32, dtype=torch.float16)
    cut = [0, *range(8, n, 16), n]  # ranges of whole row groups, the last one ending at the tail
    for r0, r1 in zip(cut, cut[1:], strict=False):
        q4_0_to_q4z(raw, packed, scales, lib, rows=(r0, r1))
    assert _same(packed, ref.packed) and _same(scales, ref.scales)
    with pytest.raises(ValueError, match="whole row groups"):
        q4_0_to_q4z(raw, packed, scales, lib, rows=(4, n))
    with pytest.raises(ValueError, match=r"packed uint8 \[N, K/2\]"):
        q4_0_to_q4z(raw, packed[:, :-1], scales, lib)


@pytest.mark.parametrize("i,h", [(32, 32), (160, 64), (64, 256)])
def test_expert_equals_the_awq_route(monkeypatch, lib, i, h):
    monkeypatch.setattr(gguf_experts, "library", lambda: lib)
    expert, raw = expert_of(i, h, 3 * i + h)
    got = gguf_experts.q4_0_int4_expert(expert, raw)
    ref = Int4Expert.from_awq_tensors(q4_0_awq_expert_tensors_reference(expert, raw), 32)
    assert got.intermediate_size == ref.intermediate_size == i
    assert _same_matrix(got.w13, ref.w13) and _same_matrix(got.w2, ref.w2)
    assert got.w13.fmt == Q4_F16Z8


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from gguf_models import T, write_gguf

    path = tmp_path_factory.mktemp("q40") / "q4_0.gguf"
    write_gguf(make_tiny_model(seed=5), path, expert_types=T.Q4_0, other_type=T.Q8_0)
    return path


@pytest.mark.parametrize("mmap", [True, False])
def test_loaded_model_equals_the_awq_route(monkeypatch, q4_0_gguf, mmap):
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    calls = []
    direct = gguf_experts.q4_0_int4_expert
    monkeypatch.setattr(gguf_experts, "q4_0_int4_expert", lambda x, raw: calls.append(x) or direct(x, raw))
    model = MoEModel.from_pretrained(q4_0_gguf, device="cpu", mmap=mmap)
    monkeypatch.setattr(build, "q4_0_direct_applies", lambda *a: False)
    awq = MoEModel.from_pretrained(q4_0_gguf, device="cpu", mmap=mmap)
    try:
        assert type(model.experts) is CpuInt4Experts and type(awq.experts) is CpuInt4Experts
        layers, experts = len(model.experts.experts), len(model.experts.experts[0])
        assert len(calls) == layers * experts  # every expert took the direct path, the second model none
        for a, b in zip(model.experts.experts, awq.experts.experts, strict=True):
            for x, y in zip(a, b, strict=True):
                assert _same_matrix(x.w13, y.w13) and _same_matrix(x.w2, y.w2)
        got = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
        assert torch.equal(got, awq.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[]))
    finally:
        model.close()
        awq.close()


@pytest.mark.parametrize("mmap", [True, False])
def test_file_cut_short_after_its_header_names_the_file(monkeypatch, tmp_path, q4_0_gguf, mmap):
    path = tmp_path / "cut.gguf"
    path.write_bytes(q4_0_gguf.read_bytes())
    start = build.DirectQ4_0Load.__init__

    def cut_then_start(self, *a, **kw):  # the header was read whole; the experts' bytes are gone
        os.truncate(path, path.stat().st_size // 2)
        start(self, *a, **kw)

    monkeypatch.setattr(build.DirectQ4_0Load, "__init__", cut_then_start)
    with pytest.raises(CheckpointError, match=str(path)):
        MoEModel.from_pretrained(path, device="cpu", mmap=mmap)


def test_a_failed_read_stops_the_load_and_names_the_file(monkeypatch, q4_0_gguf):
    read = gguf_experts.StoredQ4_0Reads.read

    def fail_one(self, layer, expert, staging):
        if (layer, expert) == (1, 2):
            raise CheckpointError(f"{q4_0_gguf}: vanished while loading")
        return read(self, layer, expert, staging)

    monkeypatch.setattr(gguf_experts.StoredQ4_0Reads, "read", fail_one)
    with pytest.raises(CheckpointError, match=f"{q4_0_gguf}: vanished"):
        MoEModel.from_pretrained(q4_0_gguf, device="cpu")


@pytest.mark.parametrize("other", ["F16", "F32"])
def test_float_lm_head_as_stored_gives_the_same_model(monkeypatch, tmp_path, other):
    """A float lm_head (llama.cpp's Q4_0 files keep output.weight F16) is quantized from the file's own dtype, a
    view of the mapping (or one read): the same int8 rows and tokens as from get's fp32 copy."""
    pytest.importorskip("gguf")
    from gguf_models import T, write_gguf

    from moeflow.io.gguf.reader import GGUFCheckpointReader

    path = tmp_path / "m.gguf"
    write_gguf(make_tiny_model(seed=6), path, expert_types=T.Q4_0, other_type=getattr(T, other))
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    views = []
    stored = GGUFCheckpointReader.stored_float
    monkeypatch.setattr(GGUFCheckpointReader, "stored_float",
                        lambda self, name, *a: views.append((name, stored(self, name, *a))) or views[-1][1])
    runs = []
    for mmap, keep in ((True, True), (False, True), (True, False)):
        if not keep:
            monkeypatch.setattr(GGUFCheckpointReader, "stored_float", lambda self, *a: None)
        model = MoEModel.from_pretrained(path, device="cpu", mmap=mmap)
        try:
            head = model.model.lm_head
            runs.append((head.int8_weight.clone(), head.int8_scales.clone(),
                         model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[])))
        finally:
            model.close()
    heads = [v for name, v in views if name == "lm_head.weight"]  # (rope-permuted q / k: None, read by get)
    assert [v.dtype for v in heads] == [getattr(torch, {"F16": "float16", "F32": "float32"}[other])] * 2
    for w, s, tokens in runs[:2]:
        assert torch.equal(w, runs[2][0]) and torch.equal(s, runs[2][1]) and torch.equal(tokens, runs[2][2])


def test_an_interrupted_build_stops_the_loader(monkeypatch, q4_0_gguf):
    """Ctrl-C while the decoder is built (the experts loading beside it): the loader threads stop and are joined
    before from_pretrained raises, and no model is returned."""
    import threading

    from moeflow.engine import loading

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    import time

    read, reads = gguf_experts.StoredQ4_0Reads.read, []

    def slow(self, layer, expert, staging):  # a slow disk: the build is interrupted with experts still to read
        time.sleep(0.2)
        reads.append((layer, expert))
        return read(self, layer, expert, staging)

    monkeypatch.setattr(gguf_experts.StoredQ4_0Reads, "read", slow)
    monkeypatch.setattr(loading, "load_non_expert_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        MoEModel.from_pretrained(q4_0_gguf, device="cpu")
    assert not [t for t in threading.enumerate() if t.name.startswith("moeflow-load")]
    n = len(reads)
    time.sleep(0.5)
    assert len(reads) == n < 8  # stopped: nothing read after from_pretrained raised, most of the 12 never read
