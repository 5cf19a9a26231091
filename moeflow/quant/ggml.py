"""GGML's block formats (what GGUF files store) dequantized exactly, in fp32, with plain vectorised torch.

These are the fp32 references for moeflow's GGUF kernels: each mirrors ggml's ``dequantize_row_*`` (ggml-quants.c)
operation for operation in fp32, so the result is bit for bit gguf-py's ``gguf.quants.dequantize`` of the same
bytes (tests/test_ggml_dequant.py checks every type on random blocks and one hand-built block each).

A row of ``n`` values of a block type is ``n / block`` blocks of ``type_size`` bytes; a tensor of GGUF shape
``[..., n]`` (outermost first, as numpy reads it) stores ``[..., n / block * type_size]`` bytes. Types:

* ``Q4_0`` (32 values, 18 bytes): fp16 ``d``, 16 bytes of nibbles; value ``j`` is ``(low(q[j]) - 8) * d`` and value
  ``j + 16`` is ``(high(q[j]) - 8) * d``.
* ``Q4_1`` (32, 20): fp16 ``d``, fp16 ``m``, nibbles as Q4_0; ``q * d + m``.
* ``Q5_0`` (32, 22) / ``Q5_1`` (32, 24): fp16 ``d`` (and ``m``), 4 bytes ``qh`` (bit ``j`` of the little-endian word
  is the fifth bit of value ``j``), nibbles as Q4_0; ``(q - 16) * d`` / ``q * d + m``.
* ``Q8_0`` (32, 34): fp16 ``d``, 32 int8 ``q``; ``q * d``.
* ``Q4_K`` (256, 144): fp16 ``d``, fp16 ``dmin``, 12 bytes packing eight 6-bit scales and mins, 128 bytes of
  nibbles; sub-block ``s`` of 32 is ``d * sc[s] * q - dmin * m[s]``; bytes ``32c..32c+31`` hold sub-block ``2c``
  in their low nibbles and ``2c + 1`` in their high ones.
* ``Q5_K`` (256, 176): as Q4_K plus 32 bytes ``qh``: bit ``s`` of ``qh[j]`` is the fifth bit of value ``j`` of
  sub-block ``s``.
* ``Q6_K`` (256, 210): 128 bytes ``ql`` (low nibbles), 64 bytes ``qh`` (2 high bits), 16 int8 scales, fp16 ``d``;
  value ``d * scale[i // 16] * (q - 32)``.
* ``MXFP4`` (32, 17): one E8M0 exponent byte ``e``, 16 bytes of e2m1 nibbles (low nibbles first);
  value ``kvalues[q] * 2^(e - 128)`` with ggml's doubled e2m1 table.
* ``F32``, ``F16``, ``BF16``: passed through (widened to fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.errors import UnsupportedQuantizationError

QK_K = 256


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: its GGUF id, name and block geometry (values and bytes per block)."""

    id: int
    name: str
    block_size: int
    type_size: int

    def row_bytes(self, n: int, what: str = "tensor") -> int:
        """Bytes of a row of ``n`` values (ValueError naming ``what`` when ``n`` is not a whole number of blocks)."""
        if n % self.block_size:
            raise ValueError(f"{what}: a row of {n} values is not a whole number of {self.name} blocks "
                             f"({self.block_size} values each)")
        return n // self.block_size * self.type_size


# ids as in ggml.h / gguf-py's GGMLQuantizationType (fixed by the file format)
TYPES: dict[int, GGMLType] = {t.id: t for t in (
    GGMLType(0, "F32", 1, 4), GGMLType(1, "F16", 1, 2), GGMLType(30, "BF16", 1, 2),
    GGMLType(2, "Q4_0", 32, 18), GGMLType(3, "Q4_1", 32, 20), GGMLType(6, "Q5_0", 32, 22),
    GGMLType(7, "Q5_1", 32, 24), GGMLType(8, "Q8_0", 32, 34), GGMLType(12, "Q4_K", QK_K, 144),
    GGMLType(13, "Q5_K", QK_K, 176), GGMLType(14, "Q6_K", QK_K, 210), GGMLType(39, "MXFP4", 32, 17),
)}
SUPPORTED = tuple(t.name for t in TYPES.values())


def ggml_type(type_id: int, what: str = "tensor", type_name: str | None = None) -> GGMLType:
    """The :class:`GGMLType` of id ``type_id``; UnsupportedQuantizationError naming ``what``, the type and the
    supported ones otherwise (``type_name``: how the file names the type, for the message)."""
    t = TYPES.get(int(type_id))
    if t is None:
        name = type_name or _type_name(int(type_id))
        raise UnsupportedQuantizationError(f"{what}: GGML type {name} is not supported; moeflow reads "
                                           f"{', '.join(SUPPORTED)}")
    return t


def _type_name(type_id: int) -> str:
    """gguf-py's name of a ggml type id (``Q4_1``, ``IQ2_XS``, ...), or ``type id N``."""
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type id {type_id}"


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes ``[start, start + 2)`` of each block, as fp32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [n, B] -> [n, B // group, 2, group]: low nibbles of each run of ``group`` bytes, then high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # the nibbles written straight into place, q - 8 taken in uint8 (wrapping to int8's bit pattern), widened once
    # and scaled in place: the same fp32 products d * (q - 8) in fewer passes over the tensor
    n = blocks.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(blocks[:, 2:], 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(blocks[:, 2:], 4, out=q[:, 1])
    q.sub_(8)
    return q.view(torch.int8).view(n, 32).to(torch.float32).mul_(_half(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], 32)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes -> uint8 [n, 32]: bit j of the little-endian word, for value j."""
    return ((qh.reshape(-1, 4, 1) >> _on(_BITS8, qh.device).reshape(1, 1, 8)) & 1).reshape(-1, 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:], 16).reshape(blocks.shape[0], 32) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:], 16).reshape(blocks.shape[0], 32) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    return d * blocks[:, 2:].contiguous().view(torch.int8).float()


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (get_scale_min_k4), uint8 [n, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d * sc * q - dmin * m`` per sub-block of 32 (Q4_K, Q5_K): q uint8 [n, 8, 32] -> fp32 [n, 256]."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_half(blocks, 2) * mn.float()).reshape(n, 8, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_scaled(blocks, _nibbles(blocks[:, 16:], 32).reshape(blocks.shape[0], 8, 32))


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (a module constant) on ``device``, copied once per device: no host-to-device copy per call (a
    CUDA-graph capture of the torch reference path refuses one)."""
    if table.device == device:
        return table
    key = (id(table), device)
    if key not in _TABLES:
        _TABLES[key] = table.to(device)
    return _TABLES[key]


_BITS8 = torch.arange(8, dtype=torch.uint8)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    # bit s of qh[j]: sub-block s
    qh = (blocks[:, 16:48].reshape(n, 1, 32) >> _on(_BITS8, blocks.device).reshape(1, 8, 1)) & 1
    return _k_scaled(blocks, ql | (qh << 4))


_SHIFTS4 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(blocks, 208) * scales).reshape(n, 16, 1)
    ql = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)  # per half of 128: ql[0:32] low, [32:64] low, then high
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _on(_SHIFTS4, blocks.device).reshape(1, 1, 4, 1)) & 3
    q = (ql | (qh.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: ``2^(e - 128)`` as fp32 (subnormal for e < 2), uint8 [...] -> fp32 [...]."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_to_fp32_half(blocks[:, :1])
    q = _nibbles(blocks[:, 1:], 16).reshape(blocks.shape[0], 32)
    return d * _on(MXFP4_VALUES, q.device)[q.long()]


_BLOCK_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
    "Q6_K": _q6_k, "MXFP4": _mxfp4,
}


def q4_0_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows as 4-bit codes and scales: raw uint8 [N, K/32 * 18] -> (codes uint8 [N, K] in [0, 15], d fp16
    [N, K/32]); value ``(codes - 8) * d`` (each ``d`` repeated over its 32 codes) is :func:`dequantize`'s, exactly.
    That is AWQ with group 32, zero point 8 and scale ``d``: how a Q4_0 matrix becomes an AWQ one as it is."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 18)
    codes = _nibbles(blocks[:, 2:], 16).reshape(n, -1)
    return codes, blocks[:, :2].contiguous().view(torch.float16).reshape(n, -1)


def dequantize(raw: torch.Tensor, type_id: int, what: str = "tensor") -> torch.Tensor:
    """Bytes of a GGML tensor -> its values in fp32, exactly as ggml (and gguf-py) dequantize them.

    raw: uint8 [..., row_bytes] (rows of whole blocks, as GGUF stores a tensor; on any device: a CUDA pool's
    regions for the kernels' reference); returns fp32 [..., values]
    with ``values = row_bytes / type_size * block_size``. ``what`` names the tensor in errors (an unsupported
    type names the supported ones)."""
    t = ggml_type(type_id, what)
    if raw.dtype != torch.uint8:
        raise ValueError(f"{what}: dequantize takes the raw bytes (uint8), got {raw.dtype}")
    *lead, nbytes = raw.shape
    if nbytes % t.type_size:
        raise ValueError(f"{what}: a row of {nbytes} bytes is not a whole number of {t.name} blocks "
                         f"({t.type_size} bytes each)")
    values = nbytes // t.type_size * t.block_size
    if t.name == "F32":
        return raw.contiguous().view(torch.float32).clone()
    if t.name in ("F16", "BF16"):
        return raw.contiguous().view(torch.float16 if t.name == "F16" else torch.bfloat16).float()
    blocks = raw.reshape(-1, t.type_size)
    return _BLOCK_DEQUANT[t.name](blocks).reshape(*lead, values)
