"""moeflow's CPU weight forms on transparent huge pages (issue 42, kernels/cpu/hugepages.py): the allocator's
tensors lie in anonymous mappings advised MADV_HUGEPAGE (``hg`` in /proc/self/smaps' VmFlags), the forms a
``device="cpu"`` model builds (resident q4 experts from AWQ and from a Q4_0 GGUF, the fused attention, the int8
lm_head) are on them, ``MOEFLOW_HUGEPAGES=0`` gives plain tensors, and the tokens and logits are the same either
way (the same bytes in another allocation). Skipped, with the reason, where the kernel has no THP or it is
``never``. A load (from_pretrained: hugepages.deferred) writes them on small pages and a background thread collapses
them onto huge pages (MADV_COLLAPSE) once the model is ready: tokens before and after it are the same. ~10 s."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from helpers import make_tiny_checkpoint, make_tiny_model

from moeflow import MoEModel
from moeflow.kernels.cpu import hugepages, thp_collapse
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear
from moeflow.moe import CpuInt4Experts

# hidden 256, intermediate 512: every expert matrix (w13 128 KB, w2 64 KB packed), the fused q/k/v and the lm_head
# (vocab 512: 128 KB of int8) at or above hugepages.MIN_BYTES
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_local_experts=4, vocab_size=512)


def _need_thp() -> None:
    if not hugepages.enabled():
        pytest.skip(f"no transparent huge pages to advise here (platform {sys.platform}, THP mode "
                    f"{hugepages.thp_mode()!r}, {hugepages.ENV}={os.environ.get(hugepages.ENV)!r})")


def _advised(t: torch.Tensor) -> bool:
    m = hugepages.mapping_of(t)
    return m is not None and "hg" in m["flags"]


def test_empty_places_large_tensors_on_advised_anonymous_mappings(monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    _need_thp()
    big = hugepages.empty((5, 1 << 20), torch.float16)  # 10 MB: a chunk's share
    own = hugepages.empty((3, 7 << 20), torch.uint8)  # 21 MB: a mapping of its own
    small = hugepages.empty((100,), torch.float32)
    for t in (big, own):
        m = hugepages.mapping_of(t)
        assert m is not None and "hg" in m["flags"] and m["pathname"] == "", m
        assert t.is_contiguous() and t.data_ptr() % hugepages.ALIGN == 0
    assert own.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not _advised(small) or os.environ.get("THP_MEM_ALLOC_ENABLE")
    # arena tensors under CHUNK / 2 share a mapping, without overlapping
    a, b = hugepages.empty((1 << 20,), torch.uint8), hugepages.empty((1 << 20,), torch.uint8)
    if hugepages.mapping_of(a)["range"] == hugepages.mapping_of(b)["range"]:  # (else a fresh chunk began)
        assert abs(a.data_ptr() - b.data_ptr()) >= 1 << 20
    a.fill_(1)
    b.fill_(2)
    assert int(a.sum()) == 1 << 20 and int(b.sum()) == 2 << 20
    src = torch.arange(3 << 20, dtype=torch.int32).view(3, -1)
    assert torch.equal(hugepages.copy(src), src) and _advised(hugepages.copy(src))
    parts = [src[:1], src[1:]]
    assert torch.equal(hugepages.cat(parts), src) and _advised(hugepages.cat(parts))
    own[2, -1] = 7  # the last byte is writable (the view ends inside its mapping)
    assert int(own[2, -1]) == 7


def test_a_loads_forms_go_on_small_pages_then_are_collapsed_onto_huge_pages(monkeypatch):
    """Inside deferred() (a load), mappings are not advised (written on 4 KB pages); on leaving it the background
    thread advises and collapses their written extents (MADV_COLLAPSE), the values unchanged; after it, a fresh
    chunk is advised at once; MOEFLOW_HUGEPAGES=fault advises at once inside it too."""
    monkeypatch.delenv(hugepages.ENV, raising=False)
    _need_thp()
    with hugepages.deferred():
        own = hugepages.empty((3, 7 << 20), torch.uint8)  # a mapping of its own (22 MB of extents)
        shared = hugepages.empty((1 << 20,), torch.int32)  # in a chunk
        own.fill_(3)
        shared.copy_(torch.arange(1 << 20, dtype=torch.int32))
        for t in (own, shared):
            m = hugepages.mapping_of(t)
            assert "hg" not in m["flags"] and m["AnonHugePages"] == 0, m
    assert hugepages.wait_collapsed(60)
    stats = thp_collapse.COLLAPSER.stats
    for t in (own, shared):
        m = hugepages.mapping_of(t)
        assert "hg" in m["flags"], m
        if not stats.unsupported and not stats.failed:  # (kernel >= 6.1 and free huge pages to be had)
            assert m["AnonHugePages"] >= 2048, (m, stats)
    assert int(own.sum()) == 3 * 21 << 20
    assert torch.equal(shared, torch.arange(1 << 20, dtype=torch.int32))
    assert _advised(hugepages.empty((1 << 20,), torch.uint8))  # (the load's chunk was retired)
    monkeypatch.setenv(hugepages.ENV, hugepages.FAULT)
    with hugepages.deferred():
        assert not hugepages.deferring() and _advised(hugepages.empty((3, 7 << 20), torch.uint8))


def test_without_madv_collapse_a_loads_mappings_keep_the_advice(monkeypatch):
    """A kernel without MADV_COLLAPSE (before 6.1: EINVAL, as for the unknown advice used here): the collapsing
    thread stops trying, and the load's mappings are left advised MADV_HUGEPAGE (for khugepaged), values intact."""
    monkeypatch.delenv(hugepages.ENV, raising=False)
    _need_thp()
    monkeypatch.setattr(thp_collapse, "MADV_COLLAPSE", 0x7FFF)
    collapser = thp_collapse.Collapser()
    monkeypatch.setattr(hugepages, "COLLAPSER", collapser)
    with hugepages.deferred():
        t = hugepages.empty((3, 7 << 20), torch.uint8)
        t.fill_(5)
    assert hugepages.wait_collapsed(60)
    assert collapser.stats.unsupported and collapser.stats.collapsed == 0, collapser.stats
    assert _advised(t) and int(t.sum()) == 5 * 21 << 20


def test_the_collapse_waits_while_the_rest_of_the_process_computes(monkeypatch):
    """A collapse holds its core ~4 ms per extent inside the kernel, which stalls a decode step's OpenMP team at its
    barriers: the thread collapses only while the process's other threads idle. While the idle probe says "busy", no
    extent is collapsed (it counts its waits); once it says "idle", the collapse completes. (The probe is replaced
    here so the test does not depend on how much CPU a loaded machine gives a thread; the real probe is tested
    below.)"""
    monkeypatch.delenv(hugepages.ENV, raising=False)
    _need_thp()
    collapser = thp_collapse.Collapser()
    monkeypatch.setattr(hugepages, "COLLAPSER", collapser)
    busy = threading.Event()
    busy.set()

    def probe(window_s: float = thp_collapse.IDLE_WINDOW_S) -> bool:
        time.sleep(0.005)
        return busy.is_set()

    monkeypatch.setattr(thp_collapse, "_others_busy", probe)
    with hugepages.deferred():
        t = hugepages.empty((3, 7 << 20), torch.uint8)
        t.fill_(9)
    assert not collapser.wait(0.5)  # (still waiting for an idle process)
    assert collapser.stats.collapsed == 0 and collapser.stats.failed == 0 and collapser.stats.idle_waits > 0
    busy.clear()
    assert collapser.wait(60)
    assert collapser.stats.unsupported or collapser.stats.collapsed + collapser.stats.failed > 0, collapser.stats
    assert int(t.sum()) == 9 * 21 << 20


def test_the_idle_probe_sees_another_thread_compute():
    """thp_collapse._others_busy counts the other threads' CPU time: with a thread computing, some window of 50 ms
    sees it busy (a few tries: a loaded machine may starve the thread for one window)."""
    stop = threading.Event()

    def compute() -> None:  # (a decode's stand-in: one thread on a core, in C most of the time)
        a = torch.randn(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        assert any(thp_collapse._others_busy(0.05) for _ in range(40))
    finally:
        stop.set()
        worker.join()


def test_switched_off_gives_plain_tensors(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled()
    t = hugepages.empty((4 << 20,), torch.uint8)
    assert t.untyped_storage().resizable()  # torch's allocator (torch.frombuffer's storages are not resizable)
    assert not _advised(t) or os.environ.get("THP_MEM_ALLOC_ENABLE")


def _forms(model: MoEModel) -> dict[str, torch.Tensor]:
    """The model's CPU weight forms of MIN_BYTES or more: expert q4 matrices, quantized linears' buffers."""
    assert type(model.experts) is CpuInt4Experts
    out = {}
    for layer, row in enumerate(model.experts.experts):
        for e, x in enumerate(row):
            for name, m in (("w13", x.w13), ("w2", x.w2)):
                assert isinstance(m, Q4Matrix)
                out |= {f"{layer}.{e}.{name}.{f}": getattr(m, f) for f in ("packed", "scales", "mins")}
    for path, module in model.model.named_modules():
        if isinstance(module, CpuQuantLinear):
            out |= {f"{path}.{n}": b for n, b in module.named_buffers(recurse=False) if b is not None}
    return {k: t for k, t in out.items() if t.numel() * t.element_size() >= hugepages.MIN_BYTES}


def _checkpoints(tmp_path):
    from moeflow.tools.quantize import quantize_checkpoint

    src = make_tiny_checkpoint(tmp_path / "fp32", seed=6, **SIZES)
    yield "awq", quantize_checkpoint(src, tmp_path / "awq", group_size=32, quantize_attention=True, progress=False)
    pytest.importorskip("gguf")
    from gguf_models import T, write_gguf

    path = tmp_path / "q4_0.gguf"
    gguf_sizes = {k: v for k, v in SIZES.items() if k != "vocab_size"}  # (the tests' GGUF vocabulary: 228 at most)
    write_gguf(make_tiny_model(seed=7, **gguf_sizes), path, expert_types=T.Q4_0, other_type=T.Q8_0)
    yield "q4_0", path


@pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")
def test_cpu_forms_are_on_huge_pages_and_give_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    _need_thp()
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    madvise = thp_collapse._madvise
    monkeypatch.setattr(thp_collapse, "_madvise", lambda *a: time.sleep(0.01) or madvise(*a))  # (a slow collapse:
    for kind, path in _checkpoints(tmp_path):  # the first generate below runs while it collapses the forms)
        results = {}
        for switch in ("1", "0"):
            monkeypatch.setenv(hugepages.ENV, switch)
            model = MoEModel.from_pretrained(path, device="cpu")
            try:
                with torch.inference_mode():  # (while the background collapse of the forms may be running)
                    early = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
                assert hugepages.wait_collapsed(60)
                forms = _forms(model)
                names = {n.rsplit(".", 1)[-1] for n in forms}
                assert {"packed"} <= names and any(".w2." in n for n in forms), (kind, sorted(forms))
                if kind == "awq":  # the fused q/k/v (int4 here) and the int8 lm_head too
                    assert any("qkv_proj" in n for n in forms) and "lm_head.int8_weight" in forms, sorted(forms)
                plain = [n for n, t in forms.items() if not _advised(t)]
                if switch == "1":
                    assert not plain, (kind, plain)
                elif not os.environ.get("THP_MEM_ALLOC_ENABLE"):
                    assert len(plain) == len(forms), (kind, sorted(set(forms) - set(plain)))
                with torch.inference_mode():
                    tokens = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
                    results[switch] = tokens, model(tokens).logits
                assert torch.equal(early, tokens), kind
            finally:
                model.close()
        assert torch.equal(results["1"][0], results["0"][0]), kind
        assert torch.equal(results["1"][1], results["0"][1]), kind
