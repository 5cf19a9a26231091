"""MXFP4 (OCP microscaling FP4) as gpt-oss publishes its experts: exact plain-torch dequantization and a quantizer.

Layout of one weight ``W [N, K]`` (``nn.Linear`` orientation, ``y = x @ W.T``):

* ``blocks`` uint8 ``[N, K/32, 16]``: 32 consecutive values of a row per block, two e2m1 codes per byte, the
  low nibble holding the even element (``k = 2j``) and the high nibble the odd one (``k = 2j + 1``);
* ``scales`` uint8 ``[N, K/32]``: one e8m0 exponent per block, value ``2 ** (scale - 127)``.

An e2m1 code is ``s e1 e0 m``: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, negated when ``s`` is set. The value
``e2m1 * 2**(scale-127)`` is exact in fp32 and bf16 (both keep 8 exponent bits; e2m1 needs 2 mantissa bits),
so dequantizing is exact and the only error of an MXFP4 model is the published rounding itself.

Kernel layout (what the slot pool holds, :func:`to_kernel_layout`): the same bytes per block with the bits of
each 32-bit word (8 consecutive k) permuted so that the Triton kernel decodes a bf16 pair ``(k 2p, k 2p + 1)``
with at most three shifts (see :mod:`moeflow.kernels.experts.mxfp4`): code ``k`` of a word puts its bits
``(m, e0, e1, s)`` at ``KERNEL_BITS[k]``. A pure permutation: :func:`from_kernel_layout` inverts it exactly.

Panel layout (how the slot pool orders those blocks, :func:`to_panels`): K is cut into panels of ``P`` values
(:func:`panel_for`: ``PANEL`` = 64, the kernels' decode ``BLOCK_K``, or the largest power-of-two multiple of 32
below it that divides K), stored panel by panel: ``blocks [K/P, N, P/32, 16]``, ``scales [K/P, N, P/32]``. A tile
of rows ``n0 .. n0 + BN`` of one panel is then one contiguous byte range of weights (``BN P/2`` bytes) and one of
scales (``BN P/32`` bytes): what a kernel iteration at ``BLOCK_K = P`` reads. The published row-major order is
the same five-dimensional tensor with other strides (:func:`row_major_as_panels`), which the kernels read too.

Numeric contract of the Triton kernels (:mod:`moeflow.kernels.experts.mxfp4`) against the plain-torch reference
(``moeflow.kernels.experts.biased.biased_expert_forward_reference``, which dequantizes with :func:`dequantize_mxfp4`):
the decoded weights are bitwise the reference's; products and sums in fp32 (bf16 tensor cores with fp32
accumulation for bf16 activations), in another order; bias and activation in fp32; h and the outputs stored
in the activation dtype. Tested (tests/test_mxfp4.py, max error / max |reference|): fp32 activations < 1e-5;
bf16 < 2e-2 under the interpreter (its fp32 -> bf16 stores truncate; a GPU rounds). Staged runs are bitwise.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32  # values per scale
PANEL = 64  # k per panel of the pool's layout (module doc): moeflow.kernels.experts.mxfp4's decode BLOCK_K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# bit positions (m, e0, e1, s) of code k (0..7) in a kernel-layout word: the bf16 subnormal bit pattern of pair
# (k 2p, 2p + 1) is the word shifted left by 0 / 3 / 6 (p = 0, 1, 2) under the mask 0x81C081C0; p = 3 is gathered
KERNEL_BITS = ((6, 7, 8, 15), (22, 23, 24, 31), (3, 4, 5, 12), (19, 20, 21, 28),
               (0, 1, 2, 9), (16, 17, 18, 25), (10, 13, 14, 11), (26, 29, 30, 27))


@functools.lru_cache(maxsize=4)
def _half_word_luts(dest: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [65536] x 2: where the bits of a word's low and high 16-bit halves land (``dest`` as below)."""
    values = torch.arange(65536, dtype=torch.int64)
    lo, hi = torch.zeros_like(values), torch.zeros_like(values)
    for bit in range(16):
        lo |= ((values >> bit) & 1) << dest[bit]
        hi |= ((values >> bit) & 1) << dest[16 + bit]
    return lo.to(torch.int32), hi.to(torch.int32)  # bit 31 wraps to the sign: the same 32 bits


def _permute_word_bits(blocks: torch.Tensor, dest: list[int]) -> torch.Tensor:
    """uint8 [..., 16] -> the same shape with bit ``i`` of each little-endian 32-bit word moved to ``dest[i]``.
    Two 16-bit table lookups per word (about 5x faster than four 8-bit ones at load)."""
    lo, hi = (t.to(blocks.device) for t in _half_word_luts(tuple(dest)))
    if not blocks.is_contiguous() or blocks.storage_offset() % 4:
        blocks = blocks.clone(memory_format=torch.contiguous_format)  # an int32 view needs 4-byte alignment
    word = blocks.view(torch.int32).reshape(-1)
    from moeflow.kernels.cpu.native import library
    from moeflow.kernels.repack import permute_word_bits_native

    # the same lookups in one C pass (CPU, where moeflow's library builds)
    out = permute_word_bits_native(library() if word.device.type == "cpu" else None, word, lo, hi)
    if out is not None:
        return out.view(torch.uint8).reshape(blocks.shape)
    out = lo[(word & 0xFFFF).long()] | hi[((word >> 16) & 0xFFFF).long()]
    return out.view(torch.uint8).reshape(blocks.shape)


_TO_KERNEL = [KERNEL_BITS[i // 4][i % 4] for i in range(32)]  # published bit 4k + b -> KERNEL_BITS[k][b]
_FROM_KERNEL = [_TO_KERNEL.index(i) for i in range(32)]


def to_kernel_layout(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks as published, uint8 [..., 16] -> the kernel layout (module doc); exact, same shape."""
    return _permute_word_bits(blocks, _TO_KERNEL)


def from_kernel_layout(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_kernel_layout`."""
    return _permute_word_bits(blocks, _FROM_KERNEL)


def panel_for(K: int, panel: int = PANEL) -> int:
    """The K panel of a matrix with ``K`` inputs (a multiple of 32): the largest power-of-two multiple of 32 that
    is <= ``panel`` and divides K (gpt-oss's 2880 = 45 x 64: 64)."""
    p = max(BLOCK, panel)
    while K % p:
        p //= 2
    return p


def to_panels(t: torch.Tensor, panel: int) -> torch.Tensor:
    """Row-major blocks ``[N, K/32, 16]`` or scales ``[N, K/32]`` -> the panel layout ``[K/P, N, P/32, ...]``
    (a contiguous copy)."""
    N, G = t.shape[:2]
    g = panel // BLOCK
    return t.reshape(N, G // g, g, *t.shape[2:]).transpose(0, 1).contiguous()


def from_panels(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_panels`: ``[K/P, N, P/32, ...]`` -> ``[N, K/32, ...]`` (a view of ``t`` when it is one
    panel, else a copy)."""
    n_panels, N, g = t.shape[:3]
    return t.transpose(0, 1).reshape(N, n_panels * g, *t.shape[3:])


def row_major_as_panels(t: torch.Tensor, panel: int) -> torch.Tensor:
    """Row-major blocks ``[S, N, K/32, 16]`` / scales ``[S, N, K/32]`` of ``S`` experts as the kernels' panel-indexed
    ``[S, K/P, N, P/32, ...]``: a strided view of the same memory (no copy)."""
    return t.unflatten(2, (t.shape[2] * BLOCK // panel, panel // BLOCK)).transpose(1, 2)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` unless blocks uint8 [..., G, 16] and scales uint8 [..., G] agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} disagree with scales {tuple(scales.shape)} "
            f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])"
        )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> W [..., N, G*32] in ``dtype`` (exact)."""
    check_mxfp4(blocks, scales, "dequantize_mxfp4")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]: even elements from the low nibble
    exponent = scales.to(torch.int32) - 127
    w = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return w.flatten(-2).to(dtype)


GGML_MXFP4_BYTES = 17  # GGUF's MXFP4 block (ggml type 39): an e8m0 byte, then 16 bytes of codes


def from_ggml_mxfp4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's MXFP4 rows (ggml type 39, gpt-oss GGUF files) uint8 ``[N, K/32 * 17]`` -> the published
    ``(blocks uint8 [N, K/32, 16], scales uint8 [N, K/32])`` that the MXFP4 format writes: a byte shuffle. A ggml
    block is the exponent byte then 16 bytes holding elements 0..15 in their low nibbles and 16..31 in their high
    ones; ggml's value ``2 e2m1 * 2**(e - 128)`` equals ``e2m1 * 2**(e - 127)`` (same scale byte), except that
    ggml's code 8 is +0 where e2m1's is -0 (equal values; e = 255, OCP's NaN, differs)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % GGML_MXFP4_BYTES:
        raise ValueError(f"GGUF MXFP4 rows must be uint8 [N, blocks * {GGML_MXFP4_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    b = raw.reshape(raw.shape[0], -1, GGML_MXFP4_BYTES)
    qs = b[..., 1:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, K/32, 32] in element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), b[..., 0].contiguous()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]).

    Each block's exponent is chosen so its largest magnitude fits e2m1's range (<= 6), values are rounded to
    the nearest e2m1 value (ties towards the smaller magnitude); for tests and synthetic checkpoints.
    """
    if w.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dimension ({w.shape[-1]}) must be a multiple of {BLOCK}")
    w = w.float()
    grouped = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = grouped.abs().amax(dim=-1)
    # smallest e with amax / 2**e <= 6
    exponent = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = grouped / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude (first on ties)
    code = code | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()
