"""The exact-token invariant with GGUF K-quant and Q8_0 experts on the CPU: a tiny Qwen3-MoE file whose layer 0 holds
Q4_K gate/up and Q6_K down experts (Q4_K_M's mix) and layer 1 Q8_0 experts, loaded on ``device="cpu"`` with
``kernels="auto"``: every expert runs moeflow's native GGUF CPU kernels (``kernels/cpu/gguf.c``; the attention the
CPU int8 kernels, as for AWQ; the file's Q8_0 lm_head on its blocks, gguf.c), from a slot or, with hybrid compute
(fiddler, ``cpu_compute="always"``; fiddler over the disk tier too), from the host store's CPU form (views of the
host regions' blocks; the disk tier's reused rows copied). Every policy, at slot counts from the minimum to all
experts, with the synchronous and the random-delay transport, generates exactly the resident model's greedy tokens. A
Mixtral-layout Q4_K_M mix, resident, runs its decode steps as one native call through every layer
(engine/cpu_layers.py), the offloaded policies layer by layer: the same tokens. Resident experts are views of the
mapped file by default (``mmap=True``, engine/mapped_experts.py), a copied pool with ``mmap=False``: the same tokens.
~35 s on the 2 cores at load ~9."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("gguf")
from family_models import make_family_model  # noqa: E402
from gguf_models import T, k_mix_experts, random_k_experts, write_gguf  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.engine.mapped_experts import MappedGGUFExperts  # noqa: E402
from moeflow.kernels.cpu.gguf import GGUFLinear  # noqa: E402
from moeflow.kernels.cpu.native import native_available  # noqa: E402
from moeflow.moe import ResidentExperts  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")

EXPERTS, TOP_K, LAYERS, H, I = 8, 2, 2, 256, 256
ALL_SLOTS = LAYERS * EXPERTS
NEW_TOKENS = 6
CASES = [*((p, None) for p in ("ondemand", "lru", "static")), ("fiddler", None), ("lru", "always")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_cpu_invariant")
    model = make_family_model("qwen3_moe", seed=7, norm_topk_prob=True, hidden_size=H, moe_intermediate_size=I,
                              num_hidden_layers=LAYERS, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    raw = {(0, proj): (random_k_experts(kind, EXPERTS, H if proj == "down" else I, seed), getattr(T, kind))
           for seed, (proj, kind) in enumerate((("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K")))}
    path = root / "m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw)  # layer 1: Q8_0 experts
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    resident = MoEModel.from_pretrained(path, dtype=torch.float32, offload=OffloadConfig(policy="resident"),
                                        mmap=False)  # the experts copied into a CPU pool
    assert type(resident.experts) is ResidentExperts
    fmt = resident.experts.fmt
    assert fmt.kind == "gguf" and fmt.cpu_kernels and resident.kernels == "cpu-int4"  # and the int8 linears
    assert (fmt.gate_up_types, fmt.down_types) == (("Q8_0", "Q4_K"), ("Q8_0", "Q6_K"))
    head = resident.model.lm_head  # the file's Q8_0 output.weight on its blocks (every policy's)
    assert isinstance(head, GGUFLinear) and head.type.name == "Q8_0"
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
    resident.close()
    yield path, ids, mask, expected
    mp.undo()


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize(("policy", "cpu_compute"), CASES)
def test_cpu_kernels_give_the_resident_tokens(tiny, policy, cpu_compute, transport):
    path, ids, mask, expected = tiny
    for n_slots in (TOP_K, TOP_K + 3, ALL_SLOTS):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # hybrid compute must not be refused (and fall back)
            model = MoEModel.from_pretrained(path, dtype=torch.float32, offload=OffloadConfig(
                policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.2, seed=n_slots,
                cpu_compute=cpu_compute))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
            if policy == "fiddler" or cpu_compute == "always":  # the CPU forms: the host regions' blocks in place
                host = model.experts.host
                assert host.cpu_nbytes == 0
                lo, hi = host.buffer.data_ptr(), host.buffer.data_ptr() + host.buffer.numel()
                assert all(lo <= host.cpu_expert(1, e).down.data_ptr() < hi for e in range(EXPERTS))
        finally:
            model.close()
        assert torch.equal(out, expected), f"{policy}/{cpu_compute}/{transport} with {n_slots} slots"
        s = model.stats
        if policy == "fiddler" or cpu_compute == "always":  # misses computed on the CPU from the host store's form
            assert n_slots == ALL_SLOTS or s.prefill.cpu_experts + s.decode.cpu_experts > 0
        elif n_slots < ALL_SLOTS:
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0


@pytest.mark.parametrize("repack", ["1", "0"])
def test_mapped_experts_give_the_copied_tokens(tiny, repack, monkeypatch):
    """mmap=True (the default), resident on the CPU: every expert's blocks are views of the mapped file
    (engine/mapped_experts.py), nothing copied, except Q4_K matrices repacked into rows interleaved by 8
    (kernels/cpu/gguf_repack.py; ``MOEFLOW_GGUF_REPACK=0``: views too), and the greedy tokens those of the
    copied pool."""
    monkeypatch.setenv("MOEFLOW_GGUF_REPACK", repack)
    path, ids, mask, expected = tiny
    before = path.read_bytes()
    model = MoEModel.from_pretrained(path, dtype=torch.float32, offload=OffloadConfig(policy="resident"))
    try:
        backend = model.experts
        assert type(backend) is MappedGGUFExperts and backend.fmt.cpu_kernels
        forms = [f for row in backend.experts for f in row]
        assert len(forms) == ALL_SLOTS
        stored = [t for f in forms for t, kind in ((f.gate, f.gate_up_type), (f.up, f.gate_up_type),
                                                   (f.down, f.down_type)) if kind.name != "Q4_K_X8"]
        assert all(backend.mapping.owns(t) for t in stored)
        # layer 0's Q4_K gate and up (8 experts x 2 x 256 rows of 148 bytes per block) repacked, or none
        assert len(stored) == 3 * ALL_SLOTS - (2 * EXPERTS if repack == "1" else 0)
        assert backend.repacked_nbytes == (EXPERTS * 2 * I * H // 256 * 148 if repack == "1" else 0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=[])
    finally:
        model.close()
    assert torch.equal(out, expected)
    assert path.read_bytes() == before  # a private mapping: the file is never written


def test_fiddler_over_the_disk_tier(tiny):
    """6 of the 16 experts in host memory, the rest read from the GGUF when needed: the CPU forms of disk experts
    are the bytes read (``DiskHostStore.cpu_expert``), the tokens those of the resident model."""
    from moeflow.engine.loading import non_expert_bytes
    from moeflow.engine.memory import kv_cache_bytes
    from moeflow.io.gguf import open_gguf
    from moeflow.offload import DiskHostStore

    path, ids, mask, expected = tiny
    resident = MoEModel.from_pretrained(path, dtype=torch.float32)
    row = resident.experts.fmt.nbytes
    reserved = non_expert_bytes(resident.model) + kv_cache_bytes(resident.family.config, torch.float32, 4096)
    resident.close()
    staging = open_gguf(path).expert_source((0, 1), EXPERTS, H, I).staging_nbytes
    budget = (reserved + 2 * staging + 6 * row + row // 2) / 2**30
    model = MoEModel.from_pretrained(path, dtype=torch.float32, offload=OffloadConfig(
        policy="fiddler", gpu_expert_slots=3, host_memory_gb=budget, disk_readers=2))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        assert isinstance(model.experts.host, DiskHostStore) and model.experts.host.on_disk
        assert torch.equal(out, expected)
        assert model.stats.prefill.cpu_experts + model.stats.decode.cpu_experts > 0
        assert model.experts.host.stats.bytes_read > 0
        host = model.experts.host  # a reused row is never read in place: its form is a copy (or a private read)
        lo, hi = host.buffer.data_ptr(), host.buffer.data_ptr() + host.buffer.numel()
        assert not any(lo <= host.cpu_expert(0, e).gate.data_ptr() < hi for e in range(EXPERTS))
    finally:
        model.close()


MIXES = {"q4_k_m": [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")],
         "q4_0_mix": [("Q4_0", "Q6_K"), ("Q4_0", "Q4_0"), ("Q4_0", "Q6_K")]}


@pytest.mark.parametrize("mix", list(MIXES))
def test_one_call_layers_step_on_a_q4_k_m_mixtral(tmp_path, monkeypatch, mix):
    """A Mixtral-layout file with Q4_K_M's mix (Q4_K gate/up; Q6_K, Q4_K, Q6_K down by layer; a Q6_K lm_head, run
    on its blocks), or Q4_0 gate/up with Q6_K, Q4_0, Q6_K down (the stored Q4_0 kernel of gguf.c): resident on
    ``device="cpu"`` every decode step runs all layers as one native call (engine/cpu_layers.py, the GGUF experts
    inside it; copied or views of the mapped file); offloaded and hybrid policies run the layers one by one: the
    same greedy tokens."""
    from helpers import make_tiny_model

    import moeflow.engine.cpu_layers as cpu_layers

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOEFLOW_NATIVE_LOOP", "0")  # each decode step its own call (not engine/native_decode.py's)
    calls = [0]
    inner = cpu_layers.layers_step

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(cpu_layers, "layers_step", counted)
    experts, layers = 4, 3
    model = make_tiny_model(seed=5, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                            num_local_experts=experts, num_experts_per_tok=TOP_K)
    raw = k_mix_experts(MIXES[mix], experts, H, I)
    head = random_k_experts("Q6_K", 1, model.config.vocab_size, 9, H)[0]  # Q4_K_M's Q6_K output.weight
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw,
               raw_tensors={"output.weight": (head, T.Q6_K)})
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = None
    for mmap, kind in ((False, ResidentExperts), (True, MappedGGUFExperts)):  # copied pool, views of the file
        resident = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu", mmap=mmap)
        try:
            assert type(resident.experts) is kind
            fmt = resident.experts.fmt
            assert fmt.gate_up_types == (MIXES[mix][0][0],) and fmt.cpu_kernels
            assert fmt.down_types == (MIXES[mix][1][1], "Q6_K")
            lm_head = resident.model.lm_head  # the file's Q6_K blocks, not int8 of their values
            assert isinstance(lm_head, GGUFLinear) and lm_head.type.name == "Q6_K"
            assert torch.equal(lm_head.blocks, torch.from_numpy(head))
            out = resident.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        finally:
            resident.close()
        expected = out if expected is None else expected
        assert torch.equal(out, expected), f"mmap={mmap}"
        assert calls[0] == NEW_TOKENS - 1, f"mmap={mmap}"  # every decode step in one call (the prefill by layer)
        calls[0] = 0
    for policy, cpu_compute in (("lru", None), ("fiddler", None), ("static", "always")):
        offloaded = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=TOP_K + 1, cpu_compute=cpu_compute))
        try:
            out = offloaded.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        finally:
            offloaded.close()
        assert torch.equal(out, expected), f"{policy}/{cpu_compute}"
    assert calls[0] == 0  # the offloaded layers ran one by one
