"""The Gated DeltaNet kernels' launch paths (:mod:`moeflow.kernels.deltanet.kernels`): launched directly in eager
mode, through ``torch.ops.moeflow.gdn_*`` custom ops (in-place state writes declared) while ``torch.compile``
traces, as :mod:`moeflow.kernels.experts.ops` does for the expert kernels.

The torch references are :mod:`moeflow.families.gated_deltanet`'s (``GatedDeltaNet.conv``,
``GatedDeltaNet.rule_inputs`` + ``recurrent_gated_delta_rule``); :class:`~moeflow.families.gated_deltanet.GatedDeltaNet`
picks one or the other. Importing this module imports no Triton (a CPU without ``TRITON_INTERPRET`` never does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeflow.kernels.custom_op import custom_op
from moeflow.kernels.experts.ops import check_triton_device


def _kernels():
    from moeflow.kernels.deltanet import kernels

    return kernels


def _in_place(state: Tensor) -> tuple[Tensor, bool]:
    """A contiguous tensor the kernel may write, and whether it must be copied back into ``state``."""
    return (state, False) if state.is_contiguous() else (state.contiguous(), True)


# ------------------------------------------------------------------ the decode conv
def conv_decode(qkv: Tensor, conv_state: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    """qkv [B, 1, C], conv_state [B, K-1, C] shifted in place on the rows ``mask`` [B, 1] marks real, weight
    [C, 1, K] -> silu(conv) [B, 1, C]: ``GatedDeltaNet.conv`` of one token."""
    if torch.compiler.is_compiling():
        return torch.ops.moeflow.gdn_conv_decode(qkv, conv_state, weight, mask)
    return _conv_decode(qkv, conv_state, weight, mask)


def _conv_decode(qkv: Tensor, conv_state: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    check_triton_device(qkv)
    work, copy_back = _in_place(conv_state)
    out = _kernels().conv_decode(qkv if qkv.stride(-1) == 1 else qkv.contiguous(), work, weight.contiguous(), mask)
    if copy_back:
        conv_state.copy_(work)
    return out


@custom_op("moeflow::gdn_conv_decode", mutates_args=("conv_state",))
def conv_decode_op(qkv: Tensor, conv_state: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    return _conv_decode(qkv, conv_state, weight, mask)


@conv_decode_op.register_fake
def _(qkv, conv_state, weight, mask):
    return qkv.new_empty(qkv.shape)


# ------------------------------------------------------------------ the recurrence (decode and prefill)
def recurrent(qkv: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, mask: Tensor, state: Tensor,
              num_k_heads: int, k_dim: int, out_dtype: torch.dtype) -> Tensor:
    """The gated delta rule token by token from the conv output qkv [B, T, 2 Hk dk + Hv dv] and the gates' inputs
    a, b [B, T, Hv] (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, 0 where ``mask`` [B, T] is
    False), q/k L2-normalised and q scaled by ``dk ** -0.5`` inside; state fp32 [B, Hv, dk, dv] advanced in place
    -> o [B, T, Hv, dv] in ``out_dtype``."""
    if torch.compiler.is_compiling():
        return torch.ops.moeflow.gdn_recurrent(qkv, a, b, a_log, dt_bias, mask, state, num_k_heads, k_dim, out_dtype)
    return _recurrent(qkv, a, b, a_log, dt_bias, mask, state, num_k_heads, k_dim, out_dtype)


def _recurrent(qkv: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, mask: Tensor, state: Tensor,
               num_k_heads: int, k_dim: int, out_dtype: torch.dtype) -> Tensor:
    check_triton_device(qkv)
    if a.stride() != b.stride() or a.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    work, copy_back = _in_place(state)
    out = _kernels().recurrent(qkv, a, b, a_log, dt_bias, mask, work,
                               num_k_heads, k_dim, k_dim ** -0.5, out_dtype)
    if copy_back:
        state.copy_(work)
    return out


@custom_op("moeflow::gdn_recurrent", mutates_args=("state",))
def recurrent_op(qkv: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, mask: Tensor, state: Tensor,
                 num_k_heads: int, k_dim: int, out_dtype: torch.dtype) -> Tensor:
    return _recurrent(qkv, a, b, a_log, dt_bias, mask, state, num_k_heads, k_dim, out_dtype)


@recurrent_op.register_fake
def _(qkv, a, b, a_log, dt_bias, mask, state, num_k_heads, k_dim, out_dtype):
    return qkv.new_empty((*qkv.shape[:2], *state.shape[1:2], state.shape[-1]), dtype=out_dtype)
