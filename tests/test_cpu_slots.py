"""The CPU int4 slot layout (moeflow/offload/cpu_slots.py): what a region holds, what it costs, who reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_int4 import awq_expert

import moeflow
from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.kernels.cpu.int4 import Int4Expert, Int4Matrix, int4_cpu_available
from moeflow.kernels.formats import ALIGN, AWQFormat, biased_expert_format, expert_format
from moeflow.offload.cpu_slots import CpuInt4Format, _tensor_fields, int4_expert_of
from moeflow.offload.host_store import HostStore

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")
MODEL = Path(moeflow.__file__).parent / "data" / "tiny-mixtral-awq"
AWQ = expert_format(128, 256, "awq", torch.float16, 64)


def test_region_holds_the_resident_int4_form_byte_for_byte():
    fmt = CpuInt4Format.of(AWQ)
    t = awq_expert(128, 256, 64, seed=3)
    region = torch.full((fmt.nbytes,), 7, dtype=torch.uint8)
    fmt.write(region, t)
    want, got = Int4Expert.from_awq_tensors(t, 64), fmt.int4_expert(region)
    for a, b in ((want.w13, got.w13), (want.w2, got.w2)):
        fields = _tensor_fields(a)
        assert fields and all(torch.equal(x, getattr(b, name)) for name, x in fields)
    assert got.w13.packed.data_ptr() == region.data_ptr()  # views: the slot computes its own bytes
    x, w = torch.randn(3, 128), torch.rand(3)
    assert torch.equal(got.forward(x, w), want.forward(x, w))


def test_bytes_moved_per_expert():
    """The stated figures for torch's int4 form: +1.5 bytes per group and column, +2.3 % at group 128
    (Mixtral-8x7B's shapes); in every case the region is the form's tensors, aligned, and nothing else."""
    for fmt, torch_form in ((expert_format(4096, 14336, "awq", torch.float16, 128), (91_521_024, 93_585_408)),
                            (expert_format(128, 256, "awq", torch.float16, 128), (51_200, 52_224))):
        slots = CpuInt4Format.of(fmt)
        form = slots.int4_expert(torch.zeros(slots.nbytes, dtype=torch.uint8))
        assert slots.awq_nbytes == fmt.nbytes
        assert slots.nbytes - form.nbytes < ALIGN * len(slots.specs)
        if isinstance(form.w13, Int4Matrix):
            assert (fmt.nbytes, slots.nbytes) == torch_form


def test_only_plain_awq_and_clear_errors():
    with pytest.raises(ValueError, match="plain AWQ"):
        CpuInt4Format.of(expert_format(64, 64, "dense", torch.float32))
    with pytest.raises(ValueError, match="plain AWQ"):
        CpuInt4Format.of(biased_expert_format(64, 64, "awq", torch.float16, 32))
    fmt = CpuInt4Format.of(AWQ)
    assert fmt != AWQ  # a host store of one layout is never taken for the other's
    region = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    t = awq_expert(128, 256, 64, seed=1)
    with pytest.raises(ValueError, match="w2_scales"):
        fmt.write(region, {**t, "w2_scales": t["w2_scales"][:1]})
    with pytest.raises(KeyError, match="w13_qzeros"):
        fmt.write(region, {k: v for k, v in t.items() if k != "w13_qzeros"})
    with pytest.raises(ValueError, match="int4_expert"):
        fmt.loader_tensors(region)


def test_host_store_hands_out_its_regions_for_cpu_compute():
    fmt = CpuInt4Format.of(AWQ)
    store = HostStore(fmt, 1, 2, pin=False, device="cpu")
    for e in range(2):
        store.write(0, e, awq_expert(128, 256, 64, seed=e))
    form = store.cpu_expert(0, 1)
    assert form.w13.packed.data_ptr() == store.region(0, 1).data_ptr() and store.cpu_nbytes == 0
    owned = int4_expert_of(fmt, store.region(0, 1), own=True)  # for a region that may be reused (disk tier)
    assert owned.w13.packed.data_ptr() != form.w13.packed.data_ptr()
    assert all(torch.equal(t, getattr(form.w2, name)) for name, t in _tensor_fields(owned.w2))


def test_auto_kernels_offload_into_int4_slots():
    """kernels="auto" on the CPU with an offloading policy: int4 slots (before: the torch reference)."""
    m = MoEOffloadedMixtral.from_pretrained(MODEL, offload=OffloadConfig(policy="lru", gpu_expert_slots=8))
    try:
        assert m.kernels == "cpu-int4" and isinstance(m.experts.fmt, CpuInt4Format)
        assert m.experts.int4_slots is not None and m.experts.host.fmt == m.experts.fmt
    finally:
        m.close()
    torch_ref = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="torch",
                                                    offload=OffloadConfig(policy="lru", gpu_expert_slots=8))
    try:  # the torch reference keeps the GPU kernels' AWQ layout
        assert type(torch_ref.experts.fmt) is AWQFormat and torch_ref.experts.int4_slots is None
    finally:
        torch_ref.close()


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_combine_is_the_reference_sum_bitwise(k, tokens, dtype):
    """The CPU slots' combine (a decode token's fp32 rows added in place, in k order) = kernels' torch combine."""
    from moeflow.kernels.experts.reference import combine_reference
    from moeflow.offload.cpu_slots import SlotInt4Forms

    out = (torch.randn(tokens * k, 96, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    got = SlotInt4Forms.sum_rows(out, k)
    want = combine_reference(out, k)
    assert got.dtype == want.dtype and got.shape == (tokens, 96) and torch.equal(got, want)
    assert got.data_ptr() != out.data_ptr()  # never aliases the rows (k = 1 included)


def test_all_experts_in_one_call_sum_as_the_rows_do():
    """A decode token whose k experts are all in one compute call is summed inside the kernel (the resident
    path's experts_step); bitwise the rows one call per expert leave plus the combine, whatever the order the
    experts arrive in. A stale summed row is never handed to another layer's combine."""
    from moeflow.offload.cpu_slots import SlotInt4Forms

    m = MoEOffloadedMixtral.from_pretrained(MODEL, kernels="cpu-int4", offload=OffloadConfig(policy="lru"))
    try:
        forms = m.experts.compute.int4_slots
        if not forms.forms[0].native:
            pytest.skip("moeflow's native CPU kernels were not built here (no C compiler): torch's int4 rows run")
        hidden = m.config.hidden_size
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0))
        ids, w = torch.tensor([[5, 2]], dtype=torch.int32), torch.tensor([[0.7, 0.3]])
        fused_out, rows_out = torch.empty(2, hidden), torch.empty(2, hidden)
        forms.compute(0, x, ids, w, fused_out, [2, 5], [9, 3])  # plan order, not the token's k order
        assert forms._summed is not None and forms._summed[0] is fused_out
        for e, slot in ((2, 9), (5, 3)):
            forms.compute(0, x, ids, w, rows_out, [e], [slot])
        assert forms._summed[0] is fused_out  # one-expert calls leave rows, not a summed row
        stale = forms.combine(rows_out, 2)  # another layer's rows: summed from them, not the kept row
        assert torch.equal(stale, SlotInt4Forms.sum_rows(rows_out, 2)) and forms._summed is None
        forms.compute(0, x, ids, w, fused_out, [5, 2], [3, 9])
        fused = forms.combine(fused_out, 2)
        assert fused.shape == (1, hidden) and torch.equal(fused, stale)
    finally:
        m.close()
