"""The AutoAWQ "GEMM" 4-bit layout that published AWQ checkpoints use.

For a linear layer with ``in_features`` K and ``out_features`` N (``y = x @ W``, W is ``[K, N]``):

* ``qweight`` int32 ``[K, N // 8]``: eight 4-bit values per int32; nibble ``i`` holds column
  ``8 * c + AWQ_ORDER[i]`` of block ``c``.
* ``qzeros``  int32 ``[K // group, N // 8]``: the integer zero points, packed the same way.
* ``scales``  fp16  ``[K // group, N]``.
* ``W[k, n] = (q[k, n] - zero[k // group, n]) * scale[k // group, n]``.

Note that W is the transpose of ``nn.Linear.weight`` (``[N, K]``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its 8-column block
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j lives in nibble AWQ_REVERSE_ORDER[j]
SUPPORTED_GROUP_SIZES = (32, 64, 128)
PACK = 8  # 4-bit values per int32


@dataclass
class AWQTensors:
    """The three tensors of one AWQ-quantized linear layer."""

    qweight: torch.Tensor  # int32 [K, N/8]
    qzeros: torch.Tensor  # int32 [K/group, N/8]
    scales: torch.Tensor  # fp16  [K/group, N]
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]


def check_group_size(group_size: int, in_features: int, what: str = "weight") -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size} for {what}: supported group sizes are {SUPPORTED_GROUP_SIZES}")
    if in_features % group_size:
        raise ValueError(f"{what}: in_features={in_features} is not a multiple of group_size={group_size}")


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack integers in [0, 15] of shape ``[R, C]`` (C a multiple of 8) into int32 ``[R, C/8]`` in AWQ order."""
    if values.dim() != 2 or values.shape[1] % PACK:
        raise ValueError(f"pack_int4 expects [R, C] with C % 8 == 0, got shape {tuple(values.shape)}")
    if values.numel() and values.device.type != "meta" and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("pack_int4: values must lie in [0, 15]")
    return _pack_nibbles(values.to(torch.uint8))


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] in [0, 15] -> int32 [R, C/8] in AWQ order, built as bytes (a quarter of the memory traffic of
    shifting int64 words): byte ``2l + i`` of a little-endian int32 holds columns ``4i + l`` (low nibble) and
    ``4i + 2 + l`` (high), which is AWQ_ORDER read two nibbles at a time."""
    rows, cols = values.shape
    v = values.reshape(rows, cols // PACK, 2, 2, 2)  # column 4i + 2j + l of each block: [.., i, j, l]
    out = torch.empty(rows, cols // PACK, 2, 2, dtype=torch.uint8, device=values.device)  # [.., l, i]
    torch.bitwise_or(v[:, :, :, 0, :].transpose(-1, -2), v[:, :, :, 1, :].transpose(-1, -2) << 4, out=out)
    out = out.view(rows, cols // PACK, 4)
    if sys.byteorder != "little":
        out = out.flip(-1).contiguous()
    return out.view(torch.int32).reshape(rows, cols // PACK)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[R, C/8]`` -> int32 ``[R, C]`` with values in [0, 15]."""
    shifts = torch.tensor([4 * s for s in AWQ_REVERSE_ORDER], dtype=torch.int32, device=packed.device)
    out = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8], column j of each block
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """W ``[K, N]`` in the dtype of ``scales``, from the AWQ tensors (works on batched leading dims too)."""
    q = unpack_int4(qweight)  # [..., K, N]
    z = unpack_int4(qzeros)  # [..., K/g, N]
    z = z.repeat_interleave(group_size, dim=-2)
    s = scales.repeat_interleave(group_size, dim=-2)
    return ((q - z).to(scales.dtype)) * s


def quantize_rtn(weight: torch.Tensor, group_size: int = 128) -> AWQTensors:
    """Round-to-nearest 4-bit quantization with a zero point, per group of ``group_size`` input features.

    ``weight`` is an ``nn.Linear`` weight ``[N, K]``. Returns AWQ tensors with fp16 scales.
    """
    out_features, in_features = weight.shape
    check_group_size(group_size, in_features)
    if out_features % PACK:
        raise ValueError(f"out_features={out_features} is not a multiple of 8, which AWQ packing needs")
    # groups run along K, which is contiguous in [N, K]: reduce there and transpose only the 1-byte codes
    g = weight.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    w_max = g.amax(dim=2)  # [N, K/g]
    w_min = g.amin(dim=2)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15.0).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = (-torch.round(w_min / s)).clamp(0, 15)
    q = g.div(s.unsqueeze(2)).round_().add_(zeros.unsqueeze(2)).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features).T.contiguous()  # [K, N]
    return AWQTensors(
        qweight=_pack_nibbles(q),
        qzeros=_pack_nibbles(zeros.to(torch.uint8).T.contiguous()),
        scales=scales.T.contiguous(),
        group_size=group_size,
    )
