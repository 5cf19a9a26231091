"""What the hybrid-execution tests share (tests/test_hybrid*.py): the resident reference with its tie-margin
check, and one run of a policy that computes experts on the CPU, checked against it.

Tolerance: CPU experts run the int4 kernels with bf16 activations, so logits may differ from the resident
reference by bf16 rounding (relative norm error below INT4_RTOL); greedy tokens are equal whenever the
reference's top-1 / top-2 margin along the greedy path exceeds the deviation, which the reference checks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moeflow import MoEModel, OffloadConfig

INT4_RTOL = 2e-2  # as tests/test_cpu_int4.py
# constructed rates for "auto": a tiny expert (~40 KB) copies in ~1 ms, one token on the CPU takes 0.9 ms
# (within the race margin: both start), each further token 0.5 ms (two tokens: copy wins); a copy backlog
# pushes misses to the CPU. So prefill and decode exercise all three choices, deterministically.
AUTO_RATES = dict(h2d_gbps=0.04, cpu_expert_ms=0.9, cpu_token_ms=0.5)


def resident_reference(path: Path, ids: torch.Tensor, new_tokens: int, min_margin: float,
                       load: Callable = MoEModel.from_pretrained) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-resident model's greedy tokens [B, T + new_tokens] and their logits; asserts its top-1 / top-2
    margin along the generated path exceeds ``min_margin`` (so equal tokens later are not luck)."""
    resident = load(path, kernels="torch", offload=OffloadConfig(policy="resident"))
    expected = resident.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
    logits = resident(expected).logits
    top2 = logits[:, ids.shape[1] - 1 : -1].topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > min_margin, "checkpoint too close to a tie for the test"
    return expected, logits


def run_and_compare(path: Path, ids: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor, config: dict,
                    load: Callable = MoEModel.from_pretrained):
    """Load with ``OffloadConfig(**config)``, generate greedily and score ``expected``; asserts logits within
    INT4_RTOL and tokens equal to the reference. Returns the (closed) model for its stats."""
    model = load(path, kernels="torch", offload=OffloadConfig(**config))
    try:
        out = model.generate(ids, max_new_tokens=expected.shape[1] - ids.shape[1], do_sample=False,
                             eos_token_id=[])
        got = model(expected).logits
    finally:
        model.close()
    rel = float((got - logits).norm() / logits.norm())
    assert rel < INT4_RTOL, f"{config}: relative logit error {rel:.2e}"
    assert torch.equal(out, expected), f"{config}: {out} != {expected}"
    return model
