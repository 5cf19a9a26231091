"""moeflow's fp32 GGML dequantizers (moeflow/quant/ggml.py) against gguf-py's ``gguf.quants.dequantize``, bit for
bit, on random blocks (finite fp16 scales) of every supported type and odd row counts; and against scalar
transcriptions of ggml-quants.c's ``dequantize_row_*`` loops on one hand-built block per type (the bit layout).
~6 s on 2 cores (13 s with pytest's start-up)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from moeflow.errors import UnsupportedQuantizationError  # noqa: E402
from moeflow.quant.ggml import SUPPORTED, TYPES, dequantize, ggml_type  # noqa: E402

BLOCK_TYPES = [t for t in TYPES.values() if t.block_size > 1]
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}


def random_blocks(name: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks_per_row * type_size]: random bytes, every fp16 scale a finite normal-sized number."""
    t = next(t for t in TYPES.values() if t.name == name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks_per_row, t.type_size), dtype=np.uint8)
    for at in FP16_AT.get(name, ()):
        d = rng.normal(0.0, 0.05, rows * blocks_per_row).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # exponents around 2^0 (any byte is exact; these keep gguf-py from warning of overflow)
        raw[:, 0] = rng.integers(100, 150, rows * blocks_per_row)
    return raw.reshape(rows, blocks_per_row * t.type_size)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 2), (7, 5)])
def test_random_blocks_match_gguf_py_bit_for_bit(kind, rows, blocks):
    raw = random_blocks(kind.name, rows, blocks, seed=rows * 10 + blocks)
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType(kind.id))
    got = dequantize(torch.from_numpy(raw), kind.id)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, blocks * kind.block_size)
    assert np.array_equal(bits(got.numpy()), bits(want))


def test_stacked_expert_shape_is_kept():
    raw = random_blocks("Q4_0", 3 * 5, 2).reshape(3, 5, -1)  # [E, out, row_bytes]
    got = dequantize(torch.from_numpy(raw), 2)
    assert tuple(got.shape) == (3, 5, 64)
    assert np.array_equal(bits(got.numpy()), bits(gguf_dequantize(raw, gguf.GGMLQuantizationType.Q4_0)))


@pytest.mark.parametrize("name,np_dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_types_pass_through(name, np_dtype):
    kind = next(t for t in TYPES.values() if t.name == name)
    values = np.random.default_rng(1).normal(size=(3, 5)).astype(np_dtype)
    got = dequantize(torch.from_numpy(values.view(np.uint8).reshape(3, -1).copy()), kind.id)
    assert np.array_equal(got.numpy(), values.astype(np.float32))


def test_bf16_passes_through():
    values = torch.randn(4, 6).to(torch.bfloat16)
    got = dequantize(values.view(torch.uint8).reshape(4, -1), 30)
    assert torch.equal(got, values.float())


# ---------------------------------------------------------------------------------- the bit layout, block by block
def f16(x: float) -> bytes:
    return struct.pack("<e", x)


def h(b: bytes, at: int) -> float:
    return struct.unpack_from("<e", b, at)[0]


def scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    """ggml-quants.c's get_scale_min_k4."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def pack_scales_k4(sc: list[int], mn: list[int]) -> bytes:
    """Eight 6-bit scales and mins into Q4_K's 12 bytes (the inverse of get_scale_min_k4)."""
    out = bytearray(12)
    for j in range(4):
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4)
    return bytes(out)


def c_q4_0(b: bytes) -> list[float]:
    d, qs, y = h(b, 0), b[2:], [0.0] * 32
    for j in range(16):
        y[j], y[j + 16] = ((qs[j] & 0xF) - 8) * d, ((qs[j] >> 4) - 8) * d
    return y


def c_q4_1(b: bytes) -> list[float]:
    d, m, qs, y = h(b, 0), h(b, 2), b[4:], [0.0] * 32
    for j in range(16):
        y[j], y[j + 16] = (qs[j] & 0xF) * d + m, (qs[j] >> 4) * d + m
    return y


def c_q5(b: bytes, with_min: bool) -> list[float]:
    d = h(b, 0)
    m = h(b, 2) if with_min else 0.0
    (qh,) = struct.unpack_from("<I", b, 4 if with_min else 2)
    qs, y = b[8 if with_min else 6:], [0.0] * 32
    for j in range(16):
        xh0, xh1 = ((qh >> j) << 4) & 0x10, (qh >> (j + 12)) & 0x10
        x0, x1 = (qs[j] & 0x0F) | xh0, (qs[j] >> 4) | xh1
        y[j], y[j + 16] = ((x0 * d + m, x1 * d + m) if with_min else ((x0 - 16) * d, (x1 - 16) * d))
    return y


def c_q8_0(b: bytes) -> list[float]:
    d = h(b, 0)
    return [v * d for v in struct.unpack_from("<32b", b, 2)]


def c_q4_k(b: bytes, q5: bool = False) -> list[float]:
    d, dmin, scales = h(b, 0), h(b, 2), b[4:16]
    qh, ql = (b[16:48], b[48:]) if q5 else (None, b[16:])
    y, is_, u1, u2 = [], 0, 1, 2
    for j in range(0, 256, 64):
        sc, m = scale_min_k4(is_, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = scale_min_k4(is_ + 1, scales)
        d2, m2 = d * sc, dmin * m
        q = ql[j // 2: j // 2 + 32]
        for lo in range(32):
            hi = (16 if qh[lo] & u1 else 0) if q5 else 0
            y.append(d1 * ((q[lo] & 0xF) + hi) - m1)
        for lo in range(32):
            hi = (16 if qh[lo] & u2 else 0) if q5 else 0
            y.append(d2 * ((q[lo] >> 4) + hi) - m2)
        is_, u1, u2 = is_ + 2, u1 << 2, u2 << 2
    return y


def c_q6_k(b: bytes) -> list[float]:
    ql, qh, sc, d = b[:128], b[128:192], struct.unpack_from("<16b", b, 192), h(b, 208)
    y = [0.0] * 256
    for n in range(2):
        for lo in range(32):
            is_ = lo // 16
            a, c, s = 128 * n, 64 * n, 8 * n
            q1 = ((ql[c + lo] & 0xF) | (((qh[32 * n + lo] >> 0) & 3) << 4)) - 32
            q2 = ((ql[c + lo + 32] & 0xF) | (((qh[32 * n + lo] >> 2) & 3) << 4)) - 32
            q3 = ((ql[c + lo] >> 4) | (((qh[32 * n + lo] >> 4) & 3) << 4)) - 32
            q4 = ((ql[c + lo + 32] >> 4) | (((qh[32 * n + lo] >> 6) & 3) << 4)) - 32
            y[a + lo] = d * sc[s + is_] * q1
            y[a + lo + 32] = d * sc[s + is_ + 2] * q2
            y[a + lo + 64] = d * sc[s + is_ + 4] * q3
            y[a + lo + 96] = d * sc[s + is_ + 6] * q4
    return y


def c_mxfp4(b: bytes) -> list[float]:
    kvalues = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
    d = 2.0 ** (b[0] - 128)  # ggml_e8m0_to_fp32_half
    return [kvalues[q & 0xF] * d for q in b[1:]] + [kvalues[q >> 4] * d for q in b[1:]]


def hand_block(name: str) -> bytes:
    """One block with every field distinct and the high bits of Q4_K's packed scales in use."""
    nib = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(128))
    sc, mn = [1, 2, 3, 4, 17, 33, 50, 63], [0, 5, 10, 20, 40, 18, 33, 63]
    if name == "Q4_0":
        return f16(0.5) + nib[:16]
    if name == "Q4_1":
        return f16(0.5) + f16(-2.0) + nib[:16]
    if name == "Q5_0":
        return f16(0.5) + struct.pack("<I", 0xA5C3_0F96) + nib[:16]
    if name == "Q5_1":
        return f16(0.25) + f16(1.5) + struct.pack("<I", 0x1234_ABCD) + nib[:16]
    if name == "Q8_0":
        return f16(0.25) + struct.pack("<32b", *range(-16, 16))
    if name == "Q4_K":
        return f16(0.125) + f16(0.0625) + pack_scales_k4(sc, mn) + nib
    if name == "Q5_K":
        return f16(0.125) + f16(0.0625) + pack_scales_k4(sc, mn) + bytes((37 * j) % 256 for j in range(32)) + nib
    if name == "Q6_K":
        return nib + bytes((53 * j + 7) % 256 for j in range(64)) + struct.pack("<16b", *range(-8, 8)) + f16(0.03125)
    if name == "MXFP4":
        return bytes([130]) + nib[:16]
    raise KeyError(name)


C_LOOPS = {"Q4_0": c_q4_0, "Q4_1": c_q4_1, "Q5_0": lambda b: c_q5(b, False), "Q5_1": lambda b: c_q5(b, True),
           "Q8_0": c_q8_0, "Q4_K": c_q4_k, "Q5_K": lambda b: c_q4_k(b, q5=True), "Q6_K": c_q6_k,
           "MXFP4": c_mxfp4}


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda t: t.name)
def test_hand_built_block_follows_ggml_bit_layout(kind):
    block = hand_block(kind.name)
    assert len(block) == kind.type_size
    want = np.array(C_LOOPS[kind.name](block), dtype=np.float64)
    got = dequantize(torch.frombuffer(bytearray(block), dtype=torch.uint8).reshape(1, -1), kind.id)[0]
    assert got.shape[0] == kind.block_size
    assert np.array_equal(got.double().numpy(), want)  # small integers times powers of two: exact in fp32


def test_hand_built_values_spelled_out():
    q4 = dequantize(torch.frombuffer(bytearray(hand_block("Q4_0")), dtype=torch.uint8).view(1, -1), 2)[0]
    assert q4[0] == -4.0 and q4[15] == 3.5 and q4[16] == 3.5 and q4[31] == -4.0  # (0-8)/2, (15-8)/2, ...
    mx = dequantize(torch.frombuffer(bytearray(hand_block("MXFP4")), dtype=torch.uint8).view(1, -1), 39)[0]
    assert mx[7] == 12 * 4.0 and mx[9] == -1 * 4.0 and mx[16] == -12 * 4.0  # e = 130: 2^(130 - 128)


@pytest.mark.parametrize("type_id,name", [(9, "Q8_1"), (10, "Q2_K"), (20, "IQ4_NL")])
def test_unsupported_type_names_itself_and_the_supported_ones(type_id, name):
    with pytest.raises(UnsupportedQuantizationError) as e:
        dequantize(torch.zeros(1, 20, dtype=torch.uint8), type_id, "blk.0.ffn_up_exps.weight")
    msg = str(e.value)
    assert name in msg and "blk.0.ffn_up_exps.weight" in msg and all(t in msg for t in SUPPORTED)
    assert ggml_type(12).name == "Q4_K"


def test_partial_block_is_refused():
    with pytest.raises(ValueError, match="whole number of Q8_0 blocks"):
        dequantize(torch.zeros(2, 35, dtype=torch.uint8), 8, "x")
