"""Kernel launches of one offloaded MoE layer at decode with many small experts (issue 16: a layer's 8 needed
experts are one plan and one grouped launch, not 8), counted under the Triton interpreter (TRITON_INTERPRET=1).

Qwen3-MoE's routing shape (128 experts, top-8) on a tiny AWQ expert format, through ``OffloadedExperts.forward``
with the Triton kernels: every expert group the scheduler computes is one ``expert_forward`` call, i.e. one
route-plan launch plus the grouped GEMMs (gate/up, down) for all its experts, and the layer ends with one combine.
"""

from __future__ import annotations

import torch
from test_kernels_fused import _count_launches
from test_scheduling_helpers import AWQ, random_expert

from moeflow.config import OffloadConfig
from moeflow.offload import Stats, create_expert_backend

E, K = 128, 8


def _backend(slots: int):
    gen = torch.Generator().manual_seed(0)
    backend = create_expert_backend(
        OffloadConfig(policy="lru", gpu_expert_slots=slots, transport="sync"), fmt=AWQ, num_layers=1, num_experts=E,
        top_k=K, device=torch.device("cpu"), kernels_backend="triton", gates=[], reserved_bytes=0, stats=Stats())
    for e in range(E):
        backend.load_expert(0, e, random_expert(AWQ, gen))
    backend.finish_loading()  # warm start: experts 0 .. slots-1 resident
    backend.stats.set_phase("decode")
    return backend


def _decode_layer(backend, experts: list[int]) -> list[str]:
    """One decode token routed to ``experts``; the kernel launches of its layer, in order."""
    gen = torch.Generator().manual_seed(len(experts))
    x = torch.randn(1, AWQ.hidden_size, generator=gen).to(AWQ.dtype)
    ids = torch.tensor([experts], dtype=torch.int32)
    probs = torch.softmax(torch.randn(1, E, generator=gen), -1)
    w = probs.gather(1, ids.long())
    with _count_launches() as names:
        backend.forward(0, x, probs, ids, w / w.sum(-1, keepdim=True))
    return names


GEMM = "_expert_gemm_kernel"


def _groups(names: list[str]) -> int:
    """The expert groups of a layer's launches (one plan each), checking each is grouped: one launch per matrix
    (gate/up, down) for all its experts (a split K reduced inside the launch), and one combine at the end."""
    assert names[-1] == "_combine_kernel" and names.count("_combine_kernel") == 1, names
    plans = names.count("_route_plan_kernel")
    assert names.count(GEMM) == 2 * plans, names
    assert len(names) == 1 + 3 * plans, names  # nothing else: no split-K reduction launch
    return plans


def test_all_resident_layer_is_one_plan_and_one_grouped_launch_per_matrix():
    backend = _backend(slots=E)
    try:
        names = _decode_layer(backend, [3, 17, 29, 40, 64, 77, 101, 127])
    finally:
        backend.close()
    assert names[0] == "_route_plan_kernel" and _groups(names) == 1
    assert names.count(GEMM) == 2 and len(names) <= 5  # not 8 launches per matrix


def test_hits_and_misses_are_two_groups_not_one_per_expert():
    """Reordered inference: the resident experts in one call, then the loads that landed in one more (the sync
    transport lands all of them at once)."""
    backend = _backend(slots=12)
    try:
        mixed = _decode_layer(backend, [0, 1, 2, 3, 50, 60, 70, 80])  # 4 warm-start hits, 4 misses
        hits = backend.stats.decode.hits
    finally:
        backend.close()
    assert hits == 4
    assert _groups(mixed) == 2 and mixed.count(GEMM) <= 4
