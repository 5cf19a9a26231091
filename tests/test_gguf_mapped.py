"""GGUF experts as views of a copy-on-write mapping of the file (engine/mapped_experts.py, io/gguf/mapped.py): a file
cut short between opening and mapping is a CheckpointError naming the file and the tensor at load (not a SIGBUS
at the first touch); a write through a view never reaches the file; the views keep their mapping alive after the
backend is gone. (The greedy tokens: tests/test_gguf_cpu_invariant.py, tests/test_invariant_gguf_q4_k_m.py.) ~3 s."""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("gguf")
from gguf_models import T, k_mix_experts, write_gguf  # noqa: E402
from helpers import make_tiny_model  # noqa: E402

from moeflow.engine.mapped_experts import MappedGGUFExperts  # noqa: E402
from moeflow.errors import CheckpointError  # noqa: E402
from moeflow.io.gguf import open_gguf  # noqa: E402
from moeflow.io.gguf.mapped import MappedGGUF  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.kernels.formats import gguf_expert_format  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

H = I = 256
EXPERTS = 4


@pytest.fixture
def q4_k_m(tmp_path):
    model = make_tiny_model(seed=5, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                            num_local_experts=EXPERTS, num_experts_per_tok=2)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0,
               raw_experts=k_mix_experts([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")], EXPERTS, H, I))
    return path


def _backend(path) -> MappedGGUFExperts:
    model = open_gguf(path)
    fmt = gguf_expert_format("Q4_K", ("Q4_K", "Q6_K"), H, I, torch.float32).with_cpu_kernels()
    return MappedGGUFExperts(fmt, model.expert_source((0, 1), EXPERTS, H, I))


def test_a_file_cut_short_after_opening_names_the_file_and_tensor(q4_k_m):
    model = open_gguf(q4_k_m)  # the tensor table read while the file was whole
    source = model.expert_source((0, 1), EXPERTS, H, I)
    last = max((s for x in source.experts.values() for s in x.slices.values()), key=lambda s: s.offset)
    os.truncate(q4_k_m, last.offset + last.nbytes - 1)
    fmt = gguf_expert_format("Q4_K", ("Q4_K", "Q6_K"), H, I, torch.float32).with_cpu_kernels()
    with pytest.raises(CheckpointError, match=rf"{q4_k_m.name} is truncated: tensor '{last.tensor}'"):
        MappedGGUFExperts(fmt, source)


def test_views_are_private_and_outlive_the_backend(q4_k_m, monkeypatch):
    monkeypatch.setenv("MOEFLOW_GGUF_REPACK", "0")  # every matrix a view (else Q4_K ones are repacked copies)
    before = q4_k_m.read_bytes()
    backend = _backend(q4_k_m)
    form = backend.experts[1][3]
    x = torch.randn(2, H)
    w = torch.tensor([0.25, 1.0])
    want = form.forward(x, w)
    assert backend.mapping.owns(form.down)
    del backend
    gc.collect()  # the form's views still hold the mapping
    assert torch.equal(form.forward(x, w), want)
    form.down[0, :4] = 7  # copy-on-write: this page is now private, the file untouched
    assert q4_k_m.read_bytes() == before
    assert not MappedGGUF().owns(form.down)


def test_stored_embedding_rows_equal_the_dequantized_table(q4_k_m):
    """The embedding used as stored (mmap=True on the CPU) looks up the values of the table dequantized at load
    (mmap=False's nn.Embedding), in the model's dtype; an id outside the table is an IndexError."""
    from moeflow import MoEModel
    from moeflow.engine.stored_embedding import StoredEmbedding

    ids = torch.tensor([[0, 5, 96, 5], [1, 2, 3, 4]])
    got = {}
    for mmap in (True, False):
        model = MoEModel.from_pretrained(q4_k_m, device="cpu", dtype=torch.bfloat16, mmap=mmap)
        try:
            embed = model.model.embed_tokens
            assert isinstance(embed, StoredEmbedding) == mmap
            got[mmap] = embed(ids)
            if mmap:
                with pytest.raises(IndexError, match="outside the embedding table"):
                    embed(torch.tensor([97]))
        finally:
            model.close()
    assert got[True].dtype == torch.bfloat16 and got[True].shape == (2, 4, H)
    assert torch.equal(got[True], got[False])
