"""Plain-torch fp32 models of moeflow's int4 and int8 CPU matrix kernels (:mod:`~moeflow.kernels.cpu.q4_matrix`,
:mod:`~moeflow.kernels.cpu.q8_matrix`): the same rounding points; only the summation order differs.

Numerics: activations rounded to int8 with one scale per token and 32 features (:func:`quantize_activations`:
max|x| / 127, relative error ~0.5% per element, averaging out in a dot product), weights exact, integer products
summed exactly per block, fp32 across blocks; fp32 in, fp32 out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeflow.kernels.cpu.native import BLOCK


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K]: the values the kernels multiply by (int8 per 32-feature block, dequantized)."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def q4_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 model of :meth:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix.matmul` /
    :meth:`~moeflow.kernels.cpu.q8_matrix.Q8Matrix.matmul` for the dequantized weight [N, K]."""
    return quantize_activations(x) @ weight.float().T


def q4_expert_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 model of :func:`~moeflow.kernels.cpu.q4_matrix.q4_expert` for dequantized w13 [2I, H] and w2 [H, I]."""
    h = q4_reference(x, w13)
    inter = w2.shape[1]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    return q4_reference(a, w2) * weights.float()[:, None]
