"""The interleaved 8-row Q4_K form (issue 42, session 19) as data: its type tag, its layout, and its inverse in plain
torch (:func:`unpack_q4k_x8`, the fp32 reference's way to its values). The native repack and kernel are
``gguf_q4kx8.c`` (driven by :mod:`moeflow.kernels.cpu.gguf_repack`); both :mod:`moeflow.kernels.cpu.gguf` and the
repack read this module, which imports neither."""

from __future__ import annotations

import torch

from moeflow.kernels.experts.gguf_reference import GGMLType, ggml_type

K_BLOCK = 256  # activation block of the K-quants (llama.cpp's Q8_K)
# Q4_K rows interleaved 8 at a time (gguf_q4kx8.c, repacked at load by moeflow.kernels.cpu.gguf_repack): no file
# type (its id is gguf.h's GG_Q4_KX8, no ggml id), 1184 bytes per 8 rows and 256 inputs, Q4_K's numbers bit for bit
Q4_K_X8 = GGMLType("Q4_K_X8", 1012, K_BLOCK, 148, -1)
Q4_K = ggml_type("Q4_K")
ROWS = 8  # rows per interleaved group
GROUP_BYTES = ROWS * Q4_K_X8.type_size  # bytes per group of 8 rows and one block of 256 inputs (1184)


def unpack_q4k_x8(x: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`repack_q4k` in plain torch: ``x`` uint8 [N, k / 256 * 148] -> Q4_K rows uint8
    [N, k / 256 * 144] (the twelve scale bytes re-encoded from the unpacked 6-bit scales and mins: the stored
    bytes of any block ggml's quantizer writes). The fp32 model's way to the interleaved form's values."""
    nb = k // Q4_K.block_size
    if x.dtype != torch.uint8 or x.dim() != 2 or x.shape[0] % ROWS or x.shape[1] != nb * Q4_K_X8.type_size:
        raise ValueError(f"unpack_q4k_x8: expected uint8 [8 n, {nb * Q4_K_X8.type_size}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    g = x.shape[0] // ROWS
    b = x.reshape(g, nb, GROUP_BYTES)

    d = b[..., 0:16].reshape(g, nb, ROWS, 2).movedim(2, 1)
    dmin = b[..., 16:32].reshape(g, nb, ROWS, 2).movedim(2, 1)
    sc = b[..., 32:96].reshape(g, nb, 8, ROWS).permute(0, 3, 1, 2)  # [g, row, nb, sub-block]
    mn = b[..., 96:160].reshape(g, nb, 8, ROWS).permute(0, 3, 1, 2)
    qs = b[..., 160:].reshape(g, nb, 4, 8, ROWS, 4).permute(0, 4, 1, 2, 3, 5).reshape(g, ROWS, nb, 128)
    scales = torch.cat([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1)
    return torch.cat([d, dmin, scales, qs], -1).reshape(x.shape[0], nb * Q4_K.type_size).contiguous()
