"""The exact-output invariant with GGUF experts at the pool level: the offloaded backend over a GGUF format gives
bitwise the all-resident outputs, for every offload policy, several slot counts and transports, on the torch path
and on the Triton kernels (``TRITON_INTERPRET=1``); the layers' down projections in two block types (Q4_K_M's
mix), so slots hold experts of either type over time. ~30 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from gguf_block_helpers import random_gguf_expert
from test_scheduling_helpers import Synthetic

from moeflow.kernels.formats import gguf_expert_format
from moeflow.moe import ResidentExperts

OFFLOAD_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")


def gguf_synthetic(gate_up: str, down: str | tuple[str, ...], H: int, I: int, kernels: str = "torch",  # noqa: E741
                   **kw) -> Synthetic:
    """The scheduling tests' synthetic layers with random GGUF experts in place of their dense ones; ``down``
    several types: layer l's down projections in ``down[l % len(down)]`` (as Q4_K_M's layers differ)."""
    downs = (down,) if isinstance(down, str) else down
    fmt = gguf_expert_format(gate_up, downs, H, I, torch.float32)
    synth = Synthetic(fmt, kernels=kernels, **kw)
    gen = torch.Generator().manual_seed(kw.get("seed", 0) + 100)
    synth.weights = {(layer, e): random_gguf_expert(fmt, gen, gate_up, downs[layer % len(downs)])
                     for layer, e in synth.weights}
    return synth


def resident(synth: Synthetic) -> ResidentExperts:
    backend = ResidentExperts(synth.fmt, synth.L, synth.E, "cpu", synth.kernels)
    for (layer, expert), t in synth.weights.items():
        backend.load_expert(layer, expert, t)
    return backend


def _check_equal(expected, got):
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"layer call {i} differs"


@pytest.fixture(scope="module")
def q4_k_m():
    synth = gguf_synthetic("Q4_K", ("Q6_K", "Q4_K"), 256, 256, layers=2, experts=5, top_k=2, seed=4, steps=4,
                           prefill_tokens=5)
    return synth, synth.run(resident(synth))


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_gguf_offloaded_matches_resident(q4_k_m, policy, transport):
    synth, expected = q4_k_m
    assert any(float(y.abs().max()) > 0 for y in expected)
    for n_slots in (2, 3, synth.L * synth.E):
        backend, stats = synth.offloaded(policy=policy, gpu_expert_slots=n_slots, transport=transport,
                                         random_delay_ms=0.5, seed=n_slots, copy_chunks=3)
        try:
            _check_equal(expected, synth.run(backend, stats))
        finally:
            backend.close()


@pytest.mark.parametrize("policy", ["lru", "mixtral-offloading"])
def test_gguf_triton_offloaded_matches_resident(policy):
    synth = gguf_synthetic("Q8_0", ("Q4_0", "Q8_0"), 64, 96, kernels="triton", layers=2, experts=4, top_k=2, seed=6,
                           steps=3, prefill_tokens=4)
    expected = synth.run(resident(synth))
    for n_slots in (2, 5):
        backend, stats = synth.offloaded(policy=policy, gpu_expert_slots=n_slots, transport="random-delay",
                                         random_delay_ms=0.5)
        try:
            _check_equal(expected, synth.run(backend, stats))
        finally:
            backend.close()
