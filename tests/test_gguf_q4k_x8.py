"""GGUF Q4_K experts repacked at load into rows interleaved 8 at a time (kernels/cpu/gguf_q4kx8.c,
kernels/cpu/gguf_repack.py): the row kernel's bits (both sum a block exactly into one integer), within fp32
summation order of the plain-torch fp32 model (gguf-py's ``gguf.quants.dequantize``, fp32 matmul), the same bits on
every ISA; a model whose mapped Q4_K experts are repacked runs its one-call decode step with the per-call path's bits
at 1, 2 and 3 threads, the bits of ``MOEFLOW_GGUF_REPACK=0`` (the experts left as views of the file), and every
offloading policy's tokens. ~25 s on the 2 cores."""

from __future__ import annotations

import pytest
import torch
from gguf_block_helpers import random_blocks
from helpers import count_calls

from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.cpu.gguf import (
    Q4_K_X8,
    GGUFCpuExpert,
    gguf_expert_reference,
    gguf_linear,
    quantize_activations,
)
from moeflow.kernels.cpu.gguf_repack import repack_q4k, repackable, repacked_expert
from moeflow.kernels.cpu.native import SIMD_NAMES, native_available
from moeflow.kernels.cpu.q4k_x8_form import unpack_q4k_x8
from moeflow.kernels.experts.gguf_reference import ggml_type
from moeflow.user_cache import cache_dir

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")
gguf = pytest.importorskip("gguf")

TOL = 1e-5  # of the output's largest magnitude: fp32 summation order only (measured 2-5e-7)
Q4_K = ggml_type("Q4_K")


def _fp32_model(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, k] @ W.T in fp32: W the Q4_K rows ``w`` dequantized by gguf-py, x rounded as the kernel's Q8_K."""
    wf = torch.from_numpy(gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType.Q4_K)).reshape(w.shape[0], k)
    return quantize_activations(x, "Q4_K") @ wf.float().T


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert scale > 0 and err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


@pytest.mark.parametrize(("n", "k"), [(3584, 1024), (1024, 3584), (40, 256)])  # Mixtral-synth gate/up and down
def test_repacked_rows_are_the_row_kernels_bits_and_the_fp32_model(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = random_blocks("Q4_K", n, k, g)
    x8 = repack_q4k(w, k)
    assert x8.shape == (n, k // 256 * 148) and torch.equal(unpack_q4k_x8(x8, k), w)
    for tokens in (1, 3, 9):  # one token, a tile of 2 + 1, a tile of 8 + 1
        x = torch.randn(tokens, k, generator=g) * 2
        y = gguf_linear(x, x8, Q4_K_X8, k)
        assert torch.equal(y, gguf_linear(x, w, "Q4_K", k))
        _close(y, _fp32_model(x, w, k))


def test_the_repacked_form_lies_on_huge_page_memory(monkeypatch):
    """The interleaved copy comes from kernels/cpu/hugepages.py: an anonymous mapping advised MADV_HUGEPAGE."""
    from moeflow.kernels.cpu import hugepages

    monkeypatch.delenv(hugepages.ENV, raising=False)
    if not hugepages.enabled():
        pytest.skip(f"no transparent huge pages to advise here (THP mode {hugepages.thp_mode()!r})")
    x8 = repack_q4k(random_blocks("Q4_K", 512, 1024, torch.Generator().manual_seed(5)), 1024)  # 296 KB
    m = hugepages.mapping_of(x8)
    assert m is not None and "hg" in m["flags"] and m["pathname"] == "", m


def test_ragged_rows_stay_on_the_row_kernel():
    w = random_blocks("Q4_K", 37, 512, torch.Generator().manual_seed(1))
    assert not repackable(w, Q4_K) and repackable(w[:32], Q4_K) and not repackable(w[:32], ggml_type("Q6_K"))
    with pytest.raises(ValueError, match="37 rows, expected a positive multiple of 8"):
        repack_q4k(w, 512)
    with pytest.raises(ValueError, match="a Q4_K_X8 matrix is contiguous groups of 8 rows"):
        gguf_linear(torch.randn(1, 512), torch.zeros(36, 2 * 148, dtype=torch.uint8), Q4_K_X8, 512)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    _close(gguf_linear(x, w, "Q4_K", 512), _fp32_model(x, w, 512))


@pytest.mark.parametrize("down", ["Q4_K", "Q6_K"])
def test_a_repacked_expert_gives_the_stored_experts_bits(down):
    g = torch.Generator().manual_seed(3)
    e = GGUFCpuExpert(random_blocks("Q4_K", 512, 256, g), random_blocks("Q4_K", 512, 256, g),
                      random_blocks(down, 256, 512, g), Q4_K, ggml_type(down))
    r, names = repacked_expert(e)
    assert names == (["gate", "up", "down"] if down == "Q4_K" else ["gate", "up"])
    assert r.gate_up_type == Q4_K_X8 and (r.down_type == Q4_K_X8) == (down == "Q4_K")
    assert r.nbytes == e.nbytes * 148 // 144 if down == "Q4_K" else r.down is e.down
    x, w = torch.randn(5, 256, generator=g), torch.rand(5, generator=g)
    assert torch.equal(r.forward(x, w), e.forward(x, w))
    assert torch.equal(gguf_expert_reference(r, x, w), gguf_expert_reference(e, x, w))  # (the unpacked values)


def _x8_outputs() -> list[torch.Tensor]:
    outs = []
    for n, k in ((64, 1024), (16, 256)):
        w = random_blocks("Q4_K", n, k, torch.Generator().manual_seed(n))
        x8 = repack_q4k(w, k)
        for tokens in (1, 2, 9):
            outs.append(gguf_linear(torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)), x8,
                                    Q4_K_X8, k))
    w = random_blocks("Q4_K", 8, 512, torch.Generator().manual_seed(7))
    blocks = w.view(8, -1, 144)
    blocks[..., 4:] = 0xFF  # every code, scale and min at its largest: the integer sums at their bounds
    for x in (torch.ones(1, 512), -torch.ones(3, 512)):
        outs.append(gguf_linear(x, repack_q4k(w, 512), Q4_K_X8, 512))
    return outs


@pytest.mark.parametrize(("isa", "want"), [("native", 2), ("avx2", 1)])
def test_each_isa_gives_the_portable_bits(isa, want):
    cache = cache_dir() / "cpu_native"
    lib = cpu_native.load(cpu_native.build(cache, isa=isa))
    if lib.mf_simd() < want:
        pytest.skip(f"this CPU has no {SIMD_NAMES[want]} (the {isa} build runs {SIMD_NAMES[lib.mf_simd()]})")
    portable = cpu_native.load(cpu_native.build(cache, isa="baseline"))
    if portable.mf_simd() != 0:
        pytest.skip("this compiler enables AVX2 by default: no portable build to compare")
    with cpu_native.using_library(lib):
        got = _x8_outputs()
    with cpu_native.using_library(portable):
        ref = _x8_outputs()
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


# ---- a model: the one-call step, the per-call path, the switch, the offloading policies ----

H, I, EXPERTS, TOP_K, NEW = 256, 512, 4, 2, 5


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A tiny Mixtral-layout GGUF with Q4_K_M's expert mix: Q4_K gate/up, Q6_K / Q4_K / Q6_K down by layer."""
    from gguf_models import T, k_mix_experts, write_gguf
    from helpers import make_tiny_model

    root = tmp_path_factory.mktemp("gguf_q4k_x8")
    model = make_tiny_model(seed=11, hidden_size=H, intermediate_size=I, num_hidden_layers=3,
                            num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    raw = k_mix_experts([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")], EXPERTS, H, I)
    path = root / "q4_k_m.gguf"
    write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw)
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield path
    mp.undo()


def _decode(model, ids: torch.Tensor, native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens and the lm_head's input at every pass (per-call path or the one-call step)."""
    model.model.layers_step.enabled = native
    seen = []
    hook = model.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    finally:
        hook.remove()
        model.model.layers_step.enabled = True
    return out, seen


def test_repacked_model_steps_as_the_per_call_path_and_the_stored_blocks(q4_k_m, monkeypatch):
    import moeflow.engine.cpu_layers as cpu_layers
    from moeflow import MoEModel, OffloadConfig
    from moeflow.engine.mapped_experts import MappedGGUFExperts

    calls = count_calls(monkeypatch, cpu_layers, "layers_step")
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    runs = {}
    threads = torch.get_num_threads()
    for repack in ("1", "0"):
        monkeypatch.setenv("MOEFLOW_GGUF_REPACK", repack)
        model = MoEModel.from_pretrained(q4_k_m, dtype=torch.float32, device="cpu")
        try:
            backend = model.experts
            assert type(backend) is MappedGGUFExperts and model.model.layers_step is not None
            kinds = {(f.gate_up_type.name, f.down_type.name) for row in backend.experts for f in row}
            assert kinds == ({("Q4_K_X8", "Q6_K"), ("Q4_K_X8", "Q4_K_X8")} if repack == "1"
                             else {("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")})
            runs[repack, "calls"] = _decode(model, ids, native=False)
            assert calls[0] == 0
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                runs[repack, t] = _decode(model, ids, native=True)
                assert calls[0] == NEW - 1  # every decode step in one call
                calls[0] = 0
        finally:
            torch.set_num_threads(threads)
            model.close()
    ref_out, ref_x = runs["1", "calls"]
    for key, (out, x) in runs.items():  # the one call at 1-3 threads, repacked or not: the per-call bits
        assert torch.equal(out, ref_out) and len(x) == len(ref_x), key
        assert all(torch.equal(a, b) for a, b in zip(x, ref_x, strict=True)), key
    monkeypatch.setenv("MOEFLOW_GGUF_REPACK", "1")
    for policy, cpu_compute in (("lru", None), ("fiddler", None), ("static", "always")):
        model = MoEModel.from_pretrained(q4_k_m, dtype=torch.float32, device="cpu", offload=OffloadConfig(
            policy=policy, gpu_expert_slots=TOP_K + 1, cpu_compute=cpu_compute))
        try:
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
        finally:
            model.close()
        assert torch.equal(out, ref_out), f"{policy}/{cpu_compute}"
