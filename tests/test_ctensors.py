"""compressed-tensors W4A16 (pack-quantized) -> AWQ GEMM layout: bitwise the weights compressed-tensors' own
decompression gives, the layout against a word written out by hand, and the settings moeflow refuses by name."""

from __future__ import annotations

import copy

import pytest
import torch

from moeflow.errors import CheckpointError, UnsupportedQuantizationError
from moeflow.quant.awq import dequantize, unpack_int4
from moeflow.quant.ctensors import ct_dequantize, ct_qweight_to_awq, ct_qzeros_to_awq, ct_scales_to_awq, ct_settings

# as llm-compressor writes it (a Qwen3-MoE W4A16 recipe: routers and lm_head ignored)
PUBLISHED = {
    "config_groups": {"group_0": {
        "format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": "weight", "block_structure": None, "dynamic": False, "group_size": 128,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "sparsity_config": {}, "transform_config": {}, "version": "0.11.0",
}


def to_int32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def test_known_word():
    """The documented layout, literally: nibble i of weight_packed word [n, w] holds q[n, 8w + i] + 8; nibble i of
    weight_zero_point word [r, g] holds zp[8r + i, g] + 8."""
    q = torch.zeros(8, 32, dtype=torch.int64)  # N = 8 outputs, K = 32 inputs, q signed
    q[0, :8] = torch.arange(-8, 0)  # row 0, inputs 0..7: stored 0..7
    packed = torch.zeros(8, 4, dtype=torch.int32)
    for n in range(8):
        for w in range(4):
            packed[n, w] = to_int32(sum((int(q[n, 8 * w + i]) + 8) << (4 * i) for i in range(8)))
    assert int(packed[0, 0]) & 0xFFFFFFFF == 0x76543210
    assert torch.equal(unpack_int4(ct_qweight_to_awq(packed)), (q + 8).T.int())  # AWQ: [K, N], unsigned
    zp = torch.arange(-8, 0).view(8, 1)  # one group, outputs 0..7
    zp_word = torch.tensor([[to_int32(sum((int(zp[i, 0]) + 8) << (4 * i) for i in range(8)))]], dtype=torch.int32)
    assert torch.equal(unpack_int4(ct_qzeros_to_awq(zp_word, 8, 1)), (zp + 8).T.int())
    assert torch.equal(unpack_int4(ct_qzeros_to_awq(None, 8, 1)), torch.full((1, 8), 8, dtype=torch.int32))


def compress(n: int, k: int, dtype: torch.dtype, symmetric: bool, group: int):
    """compressed-tensors' own packing of a random [n, k] weight (min-max scales): (packed state, its
    decompression, the signed zero points)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + group + symmetric)).to(dtype)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, zero = compute_dynamic_scales_and_zp(w, args, None)
    state = {"weight": w, "weight_scale": scale.to(dtype)}
    if not symmetric:
        state["weight_zero_point"] = zero
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert ("weight_zero_point" in packed) != symmetric
    return packed, PackedQuantizationCompressor.decompress(packed, scheme)["weight"], zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_repacked_weight_is_bitwise_compressed_tensors_decompression(dtype, symmetric, group):
    n, k = 48, 256
    packed, want, zero = compress(n, k, dtype, symmetric, group)
    qweight = ct_qweight_to_awq(packed["weight_packed"])
    qzeros = ct_qzeros_to_awq(packed.get("weight_zero_point"), n, k // group)
    scales = ct_scales_to_awq(packed["weight_scale"])
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8) and scales.shape == (k // group, n)
    got = dequantize(qweight, qzeros, scales, group).T
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    if not symmetric:  # compressed-tensors < 0.10 stored the zero points unpacked (int8 [N, G]): the same zeros
        assert torch.equal(ct_qzeros_to_awq(zero.to(torch.int8), n, k // group), qzeros)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantized_weight_is_bitwise_compressed_tensors_decompression(symmetric):
    """What moeflow keeps 16-bit (a quantized lm_head of a vocabulary that is no multiple of 8, here 97 rows)."""
    packed, want, zero = compress(97, 64, torch.bfloat16, symmetric, 32)
    got = ct_dequantize(packed["weight_packed"], packed["weight_scale"], packed.get("weight_zero_point"))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    if not symmetric:
        assert torch.equal(ct_dequantize(packed["weight_packed"], packed["weight_scale"], zero.to(torch.int8)), want)


def test_malformed_tensors_are_refused_naming_them():
    with pytest.raises(CheckpointError, match=r"'x\.weight_packed'.*not a multiple of 8"):
        ct_qweight_to_awq(torch.zeros(12, 4, dtype=torch.int32), "x.weight_packed")
    with pytest.raises(CheckpointError, match=r"'x\.weight_zero_point' is torch.int32 \(3, 2\).* \(2, 2\)"):
        ct_qzeros_to_awq(torch.zeros(3, 2, dtype=torch.int32), 16, 2, "x.weight_zero_point")
    with pytest.raises(CheckpointError, match=r"'x\.weight_zero_point': an int4 zero point outside"):
        ct_qzeros_to_awq(torch.full((16, 2), 9, dtype=torch.int8), 16, 2, "x.weight_zero_point")
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale' is torch.float8_e4m3fn"):
        ct_scales_to_awq(torch.zeros(16, 2, dtype=torch.float8_e4m3fn), "x.weight_scale")


def test_settings():
    assert ct_settings(PUBLISHED, "config.json") == (128, True)
    asym = copy.deepcopy(PUBLISHED)
    asym["config_groups"]["group_0"]["weights"].update(symmetric=False, group_size=32, actorder=None)
    assert ct_settings(asym, "config.json") == (32, False)
    two = copy.deepcopy(PUBLISHED)  # several groups with one setting (experts and attention targeted apart)
    two["config_groups"]["group_1"] = copy.deepcopy(two["config_groups"]["group_0"])
    assert ct_settings(two, "config.json") == (128, True)


def _changed(path: str, value) -> dict:
    qc = copy.deepcopy(PUBLISHED)
    *keys, last = path.split(".")
    at = qc
    for key in keys:
        at = at[key]
    at[last] = value
    return qc


W = "config_groups.group_0.weights"
FP8_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
REFUSED = [
    (f"{W}.num_bits", 8, r"group_0\.weights\.num_bits=8 is not supported \(only 4-bit\)"),
    (f"{W}.type", "float", r"group_0\.weights\.type='float'"),  # NVFP4 / MXFP4 / FP8 weights
    (f"{W}.strategy", "channel", r"group_0\.weights\.strategy='channel'"),
    (f"{W}.strategy", "tensor", r"group_0\.weights\.strategy='tensor'"),
    (f"{W}.group_size", 16, r"group_0\.weights\.group_size=16"),
    (f"{W}.actorder", "group", r"group_0\.weights\.actorder='group' .*permutes the quantization groups"),
    (f"{W}.dynamic", True, r"group_0\.weights\.dynamic=True"),
    ("config_groups.group_0.input_activations", FP8_DYNAMIC,
     r"group_0\.input_activations: activation quantization \(W8A8, FP8 dynamic, NVFP4"),
    ("config_groups.group_0.weights", None, r"group_0\.weights is missing"),
    ("config_groups.group_0.format", "marlin-24", r"group_0\.format='marlin-24'"),
    ("format", "marlin-24", r"\.format='marlin-24' is not supported"),
    ("format", "nvfp4-pack-quantized", r"\.format='nvfp4-pack-quantized'"),
    ("sparsity_config", {"format": "sparse-24-bitmask"}, r"sparsity_config\.format='sparse-24-bitmask'"),
    ("transform_config", {"config_groups": {"R1": {}}}, r"transform_config: online transforms"),
    ("config_groups", {}, r"config_groups is empty"),
]


@pytest.mark.parametrize("path,value,match", REFUSED, ids=[f"{p}={v}" for p, v, _ in REFUSED])
def test_refused_settings_name_config_json_and_the_field(path, value, match):
    with pytest.raises(UnsupportedQuantizationError, match=rf"^config\.json: quantization_config.*{match}"):
        ct_settings(_changed(path, value), "config.json")


def test_different_settings_per_group_are_refused():
    qc = copy.deepcopy(PUBLISHED)
    qc["config_groups"]["group_1"] = copy.deepcopy(qc["config_groups"]["group_0"])
    qc["config_groups"]["group_1"]["weights"]["group_size"] = 32
    with pytest.raises(UnsupportedQuantizationError, match=r"group_0: group_size=128, symmetric=True, "
                                                           r"group_1: group_size=32, symmetric=True"):
        ct_settings(qc, "config.json")
