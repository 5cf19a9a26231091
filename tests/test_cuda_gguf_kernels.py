"""The GGUF expert kernels (moeflow/kernels/experts/gguf.py) compiled on a lent GPU, against the fp32 reference
(moeflow/kernels/experts/gguf_reference.py's dequantizers, ``biased_expert_forward_reference``) at Qwen3-30B-A3B's
expert shapes (H 2048, I 768, 128 experts, top 8), bf16 activations:

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/test_cuda_gguf_kernels.py

Block types Q4_0, Q8_0, Q4_K (gate/up) with Q4_K_M's down (Q4_K or Q6_K by region: the two-type kernel), Q6_K
with Q5_K down; decode (T = 1: the wave rule's split-K, 2 for w13 and 4 for w2; T = 4: split 4, where the rule
splits none; then bitwise the same over many launches and CUDA-graph replays, the fixup's counters back at zero)
and prefill (T = 1024: 64-row plan blocks, the pipelined tile). 24 compiled kernels (~40-60 s on the GPU, from
the AWQ kernels' 1-2 s per compile on the H100 in 2026-11-23). ``check_gguf_experts`` is the whole check;
``test_the_gpu_checks_run_interpreted`` runs it under ``TRITON_INTERPRET=1`` at tiny shapes, so the CPU suite
keeps this file's code path working (~10 s on 2 cores). The GPU tests are skipped without CUDA and under the
interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf_block_helpers import random_gguf_expert

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def on_gpu(test):
    """The GPU lane's marks: ``cuda``, skipped without CUDA and under the interpreter."""
    for mark in (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                 pytest.mark.skipif(INTERPRETED, reason="run with TRITON_INTERPRET=0: the lane checks the compiled "
                                                        "kernels")):
        test = mark(test)
    return test


QWEN3_30B_A3B = (2048, 768, 128, 8)  # hidden, expert intermediate, experts, top-k
DISTINCT = 16  # random experts in the pool; the 128 experts map onto them (the kernels read through slot_of_expert)
# (gate/up types, down types, the down type of each pool slot in turn): each type in w13 or w2, Q4_K_M's two down
# types in one pool
CASES = [("Q4_0", "Q4_0", None), ("Q8_0", "Q8_0", None), ("Q4_K", ("Q4_K", "Q6_K"), ("Q6_K", "Q4_K")),
         ("Q6_K", "Q5_K", None)]
IDS = ["Q4_0", "Q8_0", "Q4_K-Q4_K_M_down", "Q6_K-Q5_K"]


def check_gguf_experts(gate_up: str, down: str | tuple[str, ...], down_by_slot: tuple[str, ...] | None, T: int,
                       shape: tuple[int, int, int, int], device: str, dtype: torch.dtype = torch.bfloat16,
                       config: dict | None = None, expect_split: bool = False, stable_runs: int = 0) -> float:
    """One MoE layer through the GGUF kernels (``config``: the stage configs, default the wave rule's) against the
    fp32 reference: ``T`` tokens x ``shape`` = (H, I, E, k) on ``device``, the pool's regions random blocks of the
    given types (region s's down in ``down_by_slot[s % len]``). Asserts the relative error ``|out - ref| / |ref|``
    (Frobenius) < 2e-2 with 16-bit activations (the decoded weights are rounded for the MMA), 1e-5 in fp32; with
    ``expect_split`` that the default decode config splits K; with ``stable_runs`` (CUDA) that the output keeps its
    bits over that many launches and CUDA-graph replays. Returns the relative error."""
    from moeflow import kernels
    from moeflow.kernels.experts import gguf
    from moeflow.kernels.experts.biased import biased_expert_forward_reference
    from moeflow.kernels.formats import gguf_expert_format
    from moeflow.kernels.pool import ExpertPool

    H, I, E, k = shape  # noqa: E741
    gen = torch.Generator().manual_seed(T * 7 + E)
    fmt = gguf_expert_format(gate_up, down, H, I, dtype)
    slots = min(E, DISTINCT)
    pool = ExpertPool.allocate(fmt, slots, device)
    for s in range(slots):
        d = down_by_slot[s % len(down_by_slot)] if down_by_slot else None
        fmt.write(pool.buffer[s], {n: t.to(device) for n, t in random_gguf_expert(fmt, gen, gate_up, d).items()})
    slot_of_expert = (torch.randperm(E, generator=gen) % slots).to(torch.int32).to(device)
    x = torch.randn(T, H, generator=gen).to(dtype).to(device)
    ids = torch.topk(torch.rand(T, E, generator=gen), k, dim=-1).indices.to(torch.int32).to(device)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1).to(device)
    if expect_split:
        cfg = gguf.stage_configs(T, E, k, H, I, config)
        assert max(cfg["w13"]["SPLIT_K"], cfg["w2"]["SPLIT_K"]) > 1, cfg
    want = biased_expert_forward_reference(x, ids, w, pool, slot_of_expert,
                                           torch.zeros(T * k, H, dtype=dtype, device=device)).float()
    assert float(want.abs().max()) > 1e-3  # the case computes something
    out = torch.full((T * k, H), float("nan"), dtype=dtype, device=device)  # every row must be written

    def launch() -> torch.Tensor:
        return kernels.expert_forward(x, ids, w, pool, slot_of_expert, out, backend="triton", config=config)

    got = launch().clone()
    assert bool(torch.isfinite(got).all())
    err = float((got.float() - want).norm() / want.norm())
    # 16 bits: x, h, out and the MMA's weights in bf16 (~0.4 % each; the interpreter truncates: 0.7 % at tiny shapes)
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    if stable_runs:
        from cuda_helpers import assert_bitwise_stable

        assert_bitwise_stable(launch, out, got, runs=stable_runs)
    return err


@on_gpu
@pytest.mark.parametrize("gate_up, down, down_by_slot", CASES, ids=IDS)
@pytest.mark.parametrize("T, config", [(1, None), (4, {"w13": {"SPLIT_K": 4}, "w2": {"SPLIT_K": 4}})], ids=["T1", "T4"])
def test_compiled_gguf_decode_at_qwen3_shapes(gate_up, down, down_by_slot, T, config):
    check_gguf_experts(gate_up, down, down_by_slot, T, QWEN3_30B_A3B, "cuda", config=config, expect_split=True,
                       stable_runs=20)


@on_gpu
@pytest.mark.parametrize("gate_up, down, down_by_slot", CASES, ids=IDS)
def test_compiled_gguf_prefill_at_qwen3_shapes(gate_up, down, down_by_slot):
    check_gguf_experts(gate_up, down, down_by_slot, 1024, QWEN3_30B_A3B, "cuda")


@pytest.mark.skipif(not INTERPRETED, reason="the interpreted twin of the GPU tests (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("T, config", [
    (1, {"w13": {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2}, "w2": {"BLOCK_K": 128, "SPLIT_K": 2}}),
    (20, {"w13": {"BLOCK_N": 128, "BLOCK_K": 128}, "w2": {"BLOCK_K": 128}})])
def test_the_gpu_checks_run_interpreted(T, config):
    """The GPU tests' check, interpreted at tiny shapes (H = I = 256, the smallest K-quant rows; 8 experts, top
    2): the two-type Q4_K_M pool at decode (split 2) and a 20-token prefill, in fp32 (the reference's products)
    and bf16."""
    shape = (256, 256, 8, 2)
    for dtype in (torch.float32, torch.bfloat16):
        check_gguf_experts("Q4_K", ("Q4_K", "Q6_K"), ("Q6_K", "Q4_K"), T, shape, "cpu", dtype, config=config)


def test_the_reference_dequantizes_on_the_pools_device():
    """The GPU tests' reference dequantizes the CUDA pool's blocks where they are: no CPU-only constant in any block
    type's decode (the meta device stands in for CUDA here: a CPU tensor beside it fails the same way)."""
    from moeflow.kernels.experts.gguf_reference import GGML_TYPES, dequantize

    for t in GGML_TYPES.values():
        raw = torch.empty(3, 2 * t.type_size, dtype=torch.uint8, device="meta")
        out = dequantize(raw, t.name)
        assert out.device.type == "meta" and out.shape == (3, 2 * t.block_size), t.name
