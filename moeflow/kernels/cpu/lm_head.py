"""An int4 ``lm_head`` for CPU decode that keeps the int8 head's greedy tokens (``lm_head_bits=4``, issue 21).

The lm_head is a CPU decode step's largest single read (vocab x hidden: 33 MB in int8 for a 32000 x 1024 head).
In int4 (group 128: ~0.56 bytes per weight) it reads ~18 MB, but int4 moves the logits by 3-4% (relative norm,
embedded model; ~10% for Gaussian random weights such as the peer benchmark's) and changes some argmaxes. So
:class:`RefinedInt4LmHead` computes every logit from the int4 matrix, then recomputes its ``candidates`` largest
from the int8 rows (~16 KB) and writes those in their place:

* the top ``candidates`` logits (and so the greedy token and any top-k <= candidates) are exactly the int8
  head's - the same kernel on the same rows - whenever the int8 head's argmax is among the int4 head's top
  ``candidates`` (measured: always, on the embedded model and the synthetic Mixtral; a miss needs the int4 error
  to push the best logit below 15 others);
* every other logit carries int4's error (sampling with top_p / temperature sees it in the tail);
* inputs of ``EXACT_ROWS`` tokens or more (a prefill's full logits) run the int8 head itself: with many tokens
  the int8 rows are read once for all of them, and the logits are the int8 head's everywhere.

Memory: both matrices are held (int8 + int4, ~1.6x the int8 head); bytes read per decoded token: the int4 one.
:func:`refined_reference` is the plain-torch fp32 model.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.kernels.cpu.matrix_reference import q4_reference
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, quantize_linear_cpu

CANDIDATES = 16
EXACT_ROWS = 8  # tokens from which the int8 head runs alone
GROUP = 128


class RefinedInt4LmHead(nn.Module):
    """``logits = x @ W.T`` from int4 weights with the top ``candidates`` recomputed in int8 (module docstring).

    ``int4``, ``int8``: :class:`CpuQuantLinear` of the same weight ``W [vocab, hidden]`` (native kernels)."""

    def __init__(self, int4: CpuQuantLinear, int8: CpuQuantLinear, candidates: int = CANDIDATES) -> None:
        super().__init__()
        if (int4.bits, int8.bits) != (4, 8) or not (int4.native and int8.native) or \
                (int4.in_features, int4.out_features) != (int8.in_features, int8.out_features):
            raise ValueError("RefinedInt4LmHead needs an int4 and an int8 CpuQuantLinear of one weight, both on "
                             "moeflow's native CPU kernels")
        self.int4, self.int8 = int4, int8
        self.in_features, self.out_features = int8.in_features, int8.out_features
        self.candidates = min(candidates, self.out_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, candidates: int = CANDIDATES) -> RefinedInt4LmHead:
        """From the 16/32-bit weight [vocab, hidden]: int8 per row and int4 per group of 128 (or hidden)."""
        group = GROUP if weight.shape[1] % GROUP == 0 else weight.shape[1]
        return cls(quantize_linear_cpu(weight, bits=4, group_size=group), quantize_linear_cpu(weight, bits=8),
                   candidates)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [..., hidden] -> logits fp32 [..., vocab]."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] >= EXACT_ROWS:
            return self.int8(x)
        y = self.int4(rows)  # fp32 [M, V]
        top = y.topk(self.candidates, dim=-1).indices  # [M, c]
        q8 = self.int8.q8
        for m in range(rows.shape[0]):  # decode: M = 1 (a few more when a batch decodes)
            y[m].index_copy_(0, top[m], q8.matmul_rows(rows[m:m + 1], top[m])[0])
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes read per decoded token (the int4 matrix; the candidates' int8 rows are ~KBs)."""
        return self.int4.nbytes


def refined_reference(x: torch.Tensor, w4: torch.Tensor, w8: torch.Tensor, candidates: int) -> torch.Tensor:
    """fp32 model of :meth:`RefinedInt4LmHead.forward` for fewer than EXACT_ROWS tokens, from the dequantized
    int4 and int8 weights [vocab, hidden]."""
    rows = x.reshape(-1, x.shape[-1])
    y = q4_reference(rows, w4)
    top = y.topk(candidates, dim=-1).indices
    exact = q4_reference(rows, w8)
    y.scatter_(-1, top, exact.gather(-1, top))
    return y.view(*x.shape[:-1], w4.shape[0])
