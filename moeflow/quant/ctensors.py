"""compressed-tensors 4-bit checkpoints (llm-compressor's W4A16, ``format: "pack-quantized"``, as RedHatAI and
llm-compressor users publish them), converted at load into the AWQ GEMM layout the kernels read
(:mod:`moeflow.quant.awq`), bitwise the weights compressed-tensors' own decompression gives.

For a linear layer ``X`` with ``in_features`` K and ``out_features`` N, G = K / group_size groups
(``compressed_tensors/compressors/pack_quantized``):

* ``X.weight_packed`` int32 ``[N, K/8]``: packed along the *input* dimension; nibble ``i`` (bits ``4i..4i+3``) of
  word ``[n, w]`` holds ``q[n, 8w + i] + 8`` (q signed, -8..7, stored offset to 0..15);
* ``X.weight_scale``  ``[N, G]`` (the model's float dtype); ``X.weight_shape`` int64 ``[2]`` = ``(N, K)``;
* ``X.weight_zero_point`` (asymmetric only) int32 ``[N/8, G]``: packed along the *output* dimension, nibble ``i``
  of word ``[r, g]`` holds ``zp[8r + i, g] + 8``; compressed-tensors before 0.10 stored it unpacked, int8 ``[N, G]``;
* ``W[n, k] = (q[n, k] - zp[n, k // g]) * scale[n, k // g]`` in the scale's dtype (zp = 0 when symmetric).

With ``u = q + 8`` the stored nibble and ``z = zp + 8``, ``q - zp = u - z``: the weight is exactly an AWQ weight
with zero point ``z`` (8 when symmetric), the same ``(q - z) * s`` (an integer in -15..15, exact in every float
dtype, times the scale), only packed and transposed differently.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from moeflow.errors import CheckpointError, UnsupportedQuantizationError
from moeflow.quant.awq import PACK, SUPPORTED_GROUP_SIZES, _pack_nibbles

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SYMMETRIC_ZEROS = -0x77777778  # int32 0x88888888: eight zero points of 8
READABLE_ACTORDER = (None, "weight", "static")  # "weight"/"static" reorder calibration only, not the groups


def ct_settings(qc: dict[str, Any], source: str) -> tuple[int, bool]:
    """(group_size, symmetric) of a compressed-tensors ``quantization_config``; UnsupportedQuantizationError
    naming the field otherwise. Readable: every config group weight-only int4, ``strategy: group`` with a
    group size AWQ's kernels take, packed (``pack-quantized``), no sparsity or transforms, one setting for all."""
    where = f"{source}: quantization_config"
    fmt = qc.get("format")
    if fmt not in (None, FORMAT, "mixed-precision"):
        raise UnsupportedQuantizationError(
            f"{where}.format={fmt!r} is not supported (moeflow reads compressed-tensors' {FORMAT!r} int4 weights)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise UnsupportedQuantizationError(
            f"{where}.sparsity_config.format={sparsity.get('format')!r}: sparse weights are not supported")
    if (qc.get("transform_config") or {}).get("config_groups"):
        raise UnsupportedQuantizationError(
            f"{where}.transform_config: online transforms (rotations such as SpinQuant / QuIP) are not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError(f"{where}.config_groups is empty: no quantized weights are described")
    found: dict[tuple[int, bool], str] = {}
    for name, scheme in groups.items():
        found.setdefault(_group_setting(scheme or {}, f"{where}.config_groups.{name}", fmt), name)
    if len(found) > 1:
        described = ", ".join(f"{n}: group_size={g}, symmetric={s}" for (g, s), n in found.items())
        raise UnsupportedQuantizationError(
            f"{where}.config_groups use different weight settings ({described}); moeflow reads one per checkpoint")
    return next(iter(found))


def _group_setting(scheme: dict[str, Any], where: str, fmt: str | None) -> tuple[int, bool]:
    for kind in ("input_activations", "output_activations"):
        if scheme.get(kind) is not None:
            raise UnsupportedQuantizationError(
                f"{where}.{kind}: activation quantization (W8A8, FP8 dynamic, NVFP4, ...) is not supported "
                "(moeflow reads weight-only W4A16)")
    group_fmt = scheme.get("format") or fmt
    if group_fmt not in (None, FORMAT):
        raise UnsupportedQuantizationError(f"{where}.format={group_fmt!r} is not supported (only {FORMAT!r})")
    w = scheme.get("weights")
    if not w:
        raise UnsupportedQuantizationError(f"{where}.weights is missing: no weight quantization to read")
    if str(w.get("type", "int")).lower() != "int":
        raise UnsupportedQuantizationError(f"{where}.weights.type={w.get('type')!r} is not supported (only int)")
    if w.get("num_bits") != 4:
        raise UnsupportedQuantizationError(
            f"{where}.weights.num_bits={w.get('num_bits')} is not supported (only 4-bit)")
    strategy = str(w.get("strategy")).lower()
    if strategy != "group":
        raise UnsupportedQuantizationError(
            f"{where}.weights.strategy={w.get('strategy')!r} is not supported (only 'group')")
    if w.get("dynamic", False) not in (False, None):
        raise UnsupportedQuantizationError(f"{where}.weights.dynamic={w.get('dynamic')!r} is not supported")
    actorder = w.get("actorder")
    if (actorder.lower() if isinstance(actorder, str) else actorder) not in READABLE_ACTORDER:
        raise UnsupportedQuantizationError(
            f"{where}.weights.actorder={actorder!r} is not supported: it permutes the quantization groups "
            "(weight_g_idx), which the int4 kernels cannot follow; actorder='weight' checkpoints are readable")
    group = w.get("group_size")
    if group not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedQuantizationError(
            f"{where}.weights.group_size={group} is not supported (supported: {SUPPORTED_GROUP_SIZES})")
    return int(group), bool(w.get("symmetric", True))


def _nibbles_along_last(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, W]`` -> uint8 ``[R, 8W]``: nibble ``i`` of word ``w`` at column ``8w + i`` (split as bytes:
    byte ``j`` of a little-endian word holds nibbles ``2j`` (low) and ``2j + 1`` (high))."""
    rows, words = packed.shape
    b = packed.contiguous().view(torch.uint8).view(rows, words, 4)
    if sys.byteorder != "little":
        b = b.flip(-1)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(rows, words * PACK)


def _check(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}; compressed-tensors' "
                              f"{FORMAT} layout implies {dtype} {shape}")


def ct_qweight_to_awq(packed: torch.Tensor, name: str = "weight_packed") -> torch.Tensor:
    """``weight_packed`` int32 ``[N, K/8]`` -> AWQ ``qweight`` int32 ``[K, N/8]`` holding the same nibbles."""
    n, words = packed.shape
    _check(packed, torch.int32, (n, words), name)
    if n % PACK:
        raise CheckpointError(f"tensor {name!r}: out_features={n} is not a multiple of 8, which AWQ packing needs")
    return _pack_nibbles(_nibbles_along_last(packed).T.contiguous())


def ct_qzeros_to_awq(zero_point: torch.Tensor | None, out_features: int, groups: int,
                     name: str = "weight_zero_point") -> torch.Tensor:
    """AWQ ``qzeros`` int32 ``[G, N/8]``: eight 8s per word when ``zero_point`` is None (symmetric), else the
    stored zero points (``[N/8, G]`` int32 packed along N, or int8 ``[N, G]`` unpacked) offset by 8."""
    n = out_features
    if zero_point is None:
        return torch.full((groups, n // PACK), SYMMETRIC_ZEROS, dtype=torch.int32)
    if zero_point.dtype == torch.int8:  # compressed-tensors < 0.10: signed, unpacked
        _check(zero_point, torch.int8, (n, groups), name)
        if zero_point.device.type != "meta" and zero_point.numel() and (
                int(zero_point.min()) < -8 or int(zero_point.max()) > 7):
            raise CheckpointError(f"tensor {name!r}: an int4 zero point outside [-8, 7]")
        u = (zero_point.T.to(torch.int16) + 8).to(torch.uint8)
    else:
        _check(zero_point, torch.int32, (-(-n // PACK), groups), name)
        u = _nibbles_along_last(zero_point.T)[:, :n]
    return _pack_nibbles(u.contiguous())


def ct_scales_to_awq(scale: torch.Tensor, name: str = "weight_scale") -> torch.Tensor:
    """``weight_scale`` ``[N, G]`` -> AWQ ``scales`` ``[G, N]``, in its own dtype (what the weights are
    dequantized in)."""
    if scale.dim() != 2 or scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"tensor {name!r} is {scale.dtype} {tuple(scale.shape)}; a group-strategy "
                              f"weight_scale is [out_features, groups] in one of {SCALE_DTYPES}")
    return scale.T.contiguous()


def ct_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  name: str = "weight") -> torch.Tensor:
    """The weight ``[N, K]`` in the scale's dtype, as compressed-tensors decompresses it: ``(q - zp) * scale``
    per group (any N: what moeflow keeps 16-bit, such as a quantized lm_head, needs no AWQ packing)."""
    n, words = packed.shape
    _check(packed, torch.int32, (n, words), f"{name}_packed")
    groups = ct_scales_to_awq(scale, f"{name}_scale").shape[0]
    u = _nibbles_along_last(packed).to(torch.int16)  # [N, K], q + 8
    if zero_point is None:
        z = torch.full((n, groups), 8, dtype=torch.int16)
    elif zero_point.dtype == torch.int8:
        _check(zero_point, torch.int8, (n, groups), f"{name}_zero_point")
        z = zero_point.to(torch.int16) + 8
    else:
        _check(zero_point, torch.int32, (-(-n // PACK), groups), f"{name}_zero_point")
        z = _nibbles_along_last(zero_point.T)[:, :n].T.to(torch.int16)
    group = words * PACK // groups
    return (u - z.repeat_interleave(group, dim=1)).to(scale.dtype) * scale.repeat_interleave(group, dim=1)
