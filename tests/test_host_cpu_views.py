"""Hybrid compute's CPU form of a host store's expert (``HostStore.cpu_expert``): GGUF experts are computed from
their region's blocks in place (views: the tensors' data inside the host buffer, no RAM added, ``cpu_nbytes``
0), with the same bits as the converted copy, and a rewritten region gets a new form; formats whose CPU kernels
need another layout (AWQ) still convert once and count the copy. The disk tier's copies are checked in
tests/test_gguf_cpu_invariant.py. ~2 s on the 2 cores."""

from __future__ import annotations

import pytest
import torch
from gguf_block_helpers import random_gguf_expert

from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.formats import gguf_expert_format
from moeflow.offload import HostStore
from moeflow.offload.hybrid import release_freed_heap

needs_native = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here")


def _inside(t: torch.Tensor, buffer: torch.Tensor, row: int) -> bool:
    """Whether all of ``t``'s bytes lie in row ``row`` of ``buffer`` (uint8 [rows, nbytes])."""
    lo = buffer.data_ptr() + row * buffer.stride(0)
    first = t.data_ptr()
    last = first + (t.shape[0] - 1) * t.stride(0) * t.element_size() + t.shape[1] * t.element_size()
    return lo <= first and last <= lo + buffer.shape[1]


@needs_native
def test_gguf_cpu_form_reads_the_host_region_in_place():
    # Q4_K_M's mix: down in Q6_K in one expert, Q4_K (narrower rows, padded in the region) in the other
    fmt = gguf_expert_format("Q4_K", ("Q4_K", "Q6_K"), 256, 256, torch.float32)
    store = HostStore(fmt, 2, 2, pin=False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    written = {}
    for layer in range(2):
        for e in range(2):
            written[layer, e] = random_gguf_expert(fmt, gen, down="Q6_K" if e else "Q4_K")
            store.write(layer, e, written[layer, e])
    x, w = torch.randn(3, 256, generator=gen), torch.rand(3, generator=gen)
    for (layer, e), t in written.items():
        form = store.cpu_expert(layer, e)
        assert store.cpu_expert(layer, e) is form
        row = store.index(layer, e)
        for m in (form.gate, form.up, form.down):
            assert _inside(m, store.buffer, row)
        assert form.down_type.name == ("Q6_K" if e else "Q4_K")
        assert all(torch.equal(getattr(form, m)[:, : t[m].shape[1]], t[m]) for m in ("gate", "up", "down"))
        copied = fmt.cpu_expert(fmt.loader_tensors(store.region(layer, e)))  # the converted copy: same bits
        assert torch.equal(form.forward(x, w), copied.forward(x, w))
    assert store.cpu_nbytes == 0
    # a rewritten region (another down type): a new form over the new bytes
    old = store.cpu_expert(1, 1)
    store.write(1, 1, random_gguf_expert(fmt, gen, down="Q4_K"))
    new = store.cpu_expert(1, 1)
    assert new is not old and new.down_type.name == "Q4_K"
    assert torch.equal(new.forward(x, w), fmt.cpu_expert(fmt.loader_tensors(store.region(1, 1))).forward(x, w))


def test_formats_without_an_in_place_form_convert():
    from moeflow.kernels.formats import AWQFormat

    fmt = AWQFormat(128, 128, torch.float16, 32)
    assert fmt.cpu_region_expert(torch.empty(fmt.nbytes, dtype=torch.uint8)) is None  # HostStore converts once


def test_release_freed_heap_on_glibc():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert release_freed_heap() is True
