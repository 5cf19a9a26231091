"""A GGUF file's 4-bit non-expert linear layers as the CPU path's int4 layers, with the file's own codes and scales.

On ``device="cpu"`` moeflow's reader dequantizes every non-expert tensor at load (:mod:`moeflow.io.gguf.reader`),
and the CPU path then quantizes the attention projections again (int8 by default: ``engine/cpu_linears.py``). For
the block types whose values a CPU int4 form holds exactly, :class:`GGUFStoredLinears` builds the layer from the
stored blocks instead (issue 42): no second rounding, the weights llama.cpp computes with, half of int8's bytes.

* ``Q4_0`` (``(q - 8) * d`` per 32 inputs, fp16 ``d``) -> the ``Q4_F16Z8`` form (group 32, fp16 scales, no zero
  points stored: the file's 18 bytes per 32 weights), moving packed words as the Q4_0 experts do
  (:func:`~moeflow.kernels.repack.q4_0_to_q4z`, one native pass from the stored blocks; the bytes
  :meth:`~moeflow.kernels.cpu.q4_matrix.Q4Matrix.from_q4_0` makes by unpacking every code);
* ``Q4_1`` (``q * d + m`` per 32 inputs, fp16 ``d`` and ``m``) -> the ``Q4_F32`` form at group 32 (``s = d``,
  ``m = m`` in fp32: the same values; 8 bytes of scale and min per 32 weights where the file has 4);
* ``Q4_K`` (``d sc q - dmin m`` per 32 inputs, fp16 ``d`` and ``dmin`` per 256, 6-bit ``sc`` and ``m`` per 32: a
  Q4_K_M file's q / k projections) -> the ``Q4_F32`` form at group 32 (``s = d sc``, ``m = -(dmin m)``, each an
  exact fp32 product: the values ggml dequantizes; 0.75 bytes per weight against the file's 0.5625 and int8's 1).

``Q8_0``, ``Q5_K`` and ``Q6_K`` (no exact int8 / int4 CPU form: Q8_0's per-32 scales, where int8 scales rows) ->
:class:`~moeflow.kernels.cpu.gguf.GGUFLinear` on the stored blocks under ``attention_bits="auto"`` (``blocks=True``:
gguf.c's kernels, llama.cpp's pairing of weights and int8 activations; the CPU step computes them in its one call,
``step.h``'s ``MF_LINEAR_GGUF``); otherwise (``attention_bits=4``), and for F16 / BF16 / F32, they keep the path
before (dequantized at load, then int8 or int4 on the CPU). The llama architecture's
q/k rows are un-permuted as the reader does (:func:`~moeflow.io.gguf.reader.unpermute_rope_rows`): whole rows of
codes and scales move, so the values are exact. What the layers compute: each weight exactly the file's
dequantized value, times the activations rounded to int8 per 32 features (:func:`~moeflow.kernels.cpu.quant_linear.
reference_linear` with the dequantized weight is its fp32 model).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from moeflow.engine.cpu_linears import STEP_FUSED
from moeflow.io.gguf.files import TensorInfo
from moeflow.io.gguf.reader import GGUFCheckpointReader, unpermute_rope_rows
from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.gguf import K_BLOCK, GGUFLinear
from moeflow.kernels.cpu.native import library, native_available
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, group_rows, pack_q4
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear
from moeflow.kernels.repack import q4_0_to_q4z
from moeflow.quant.ggml import _half, _k_scale_min, _nibbles

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # block types read straight into a CPU int4 form
BLOCK_TYPES = ("Q8_0", "Q5_K", "Q6_K")  # attention types computed on the stored blocks (GGUFLinear) with blocks=True
GROUP = 32  # their block: the int4 group size
LM_HEAD_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # lm_head types computed on the file's blocks (GGUFLinear)


def q4_1_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows as 4-bit codes, scales and mins: raw uint8 [N, K/32 * 20] -> (codes uint8 [N, K] in [0, 15],
    d fp16 [N, K/32], m fp16 [N, K/32]); value ``codes * d + m`` as ggml dequantizes it (blocks: fp16 d, fp16 m,
    16 bytes of nibbles, value j in byte j's low nibble, value 16 + j in its high one)."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 20)
    qs = blocks[:, 4:].reshape(-1, 1, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, -1)
    d = blocks[:, :2].contiguous().view(torch.float16).reshape(n, -1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).reshape(n, -1)
    return codes, d, m


def q4_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows as 4-bit codes with a scale and a min per 32: raw uint8 [N, K/256 * 144] -> (codes uint8 [N, K] in
    [0, 15], s fp32 [N, K/32], m fp32 [N, K/32]); value ``codes * s + m``, ggml's ``d sc q - dmin mn`` (blocks: fp16
    d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: sub-block 2c the low nibbles of bytes
    32c .. 32c + 31, 2c + 1 their high ones)."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    s = _half(blocks, 0) * sc.float()
    m = -(_half(blocks, 2) * mn.float())
    return _nibbles(blocks[:, 16:], 32).reshape(n, -1), s.reshape(n, -1), m.reshape(n, -1)


class GGUFStoredLinears:
    """The CPU int4 layers a GGUF model's decoder modules can take from the file as stored (module docstring).

    ``name_of`` maps a decoder module's name (``layers.3.self_attn.q_proj``) to the HF tensor name the reader
    answers (the family's ``checkpoint_name`` of its ``.weight``). Each layer is built once and kept: the loader
    asks which weights will be taken (:func:`~moeflow.engine.cpu_linears.stored_weight_names`, so it neither reads
    nor dequantizes them) before :func:`~moeflow.engine.cpu_linears.quantize_decoder_linears` puts them in place.
    ``blocks``: the attention projections of :data:`BLOCK_TYPES` too, as GGUFLinear layers
    (``attention_bits="auto"``)."""

    def __init__(self, reader: GGUFCheckpointReader, name_of, blocks: bool = False) -> None:
        self.reader, self.name_of, self.blocks = reader, name_of, blocks
        self._built: dict[str, CpuQuantLinear | GGUFLinear | None] = {}
        self._head: list[GGUFLinear | None] = []  # [the lm_head] once built
        self._exact: dict[str, GGUFLinear | None] = {}

    def stored_type(self, module_name: str) -> str | None:
        """The ggml type the weight of ``module_name`` is stored in (None: not in the file as one tensor)."""
        info = self._tensor(module_name)
        return None if info is None else info.type.name

    def _tensor(self, module_name: str) -> TensorInfo | None:
        """The tensor info of ``module_name``'s weight where the file holds it as one tensor, else None."""
        found = self.reader.resolve(self.name_of(module_name))
        return None if found is None or found[1] is not None else found[0]

    def _blocks(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's stored bytes: uint8 [rows, bytes per row]."""
        return torch.from_numpy(np.ascontiguousarray(self.reader.files.read(info))).reshape(info.shape[0], -1)

    def lm_head(self) -> GGUFLinear | None:
        """The file's lm_head (``output.weight``) on its own blocks where it is a K-quant or Q8_0
        (:data:`LM_HEAD_TYPES`), else None (int8 of its dequantized values). A K-quant reads fewer bytes than the
        int8 head (a Q4_K_M file's Q6_K measured 1.8-2.0 against 2.6 ms of CPU per token at 32000 x 1024,
        ``benchmarks/results/peers/s16/``); Q8_0 (gpt-oss files' output.weight at every file type) reads about as
        many (34 bytes per 32 weights) and keeps the file's weights exactly, where the int8 head rounded them a
        second time (and the load dequantized and requantized the whole matrix)."""
        if not self._head:
            self._head.append(self._lm_head())
        return self._head[0]

    def _lm_head(self) -> GGUFLinear | None:
        info = self._tensor("lm_head") if native_available() else None
        if info is None:
            return None
        block = GROUP if info.type.name == "Q8_0" else K_BLOCK
        if info.type.name not in LM_HEAD_TYPES or len(info.shape) != 2 or info.shape[1] % block:
            return None
        return GGUFLinear(self._blocks(info), info.type.name, info.shape[1])

    def exact_linear(self, module_name: str) -> GGUFLinear | None:
        """``module_name``'s weight on the file's own blocks where it is stored as Q8_0 (the weights exactly,
        activations int8 per 32 as llama.cpp's Q8_0 x Q8_0), else None (no kernels here, another type, a split or
        rope-permuted tensor). For projections outside the fused CPU step (gpt-oss's biased sink attention). Built
        once (asked before the load and again when the layers are replaced)."""
        if module_name not in self._exact:
            self._exact[module_name] = self._exact_linear(module_name)
        return self._exact[module_name]

    def _exact_linear(self, module_name: str) -> GGUFLinear | None:
        info = self._tensor(module_name) if native_available() else None
        if info is None:
            return None
        if info.type.name != "Q8_0" or len(info.shape) != 2 or info.shape[1] % GROUP or (
                self.reader.arch.rope_permuted and info.name.endswith(("attn_q.weight", "attn_k.weight"))):
            return None
        return GGUFLinear(self._blocks(info), "Q8_0", info.shape[1])

    def cpu_linear(self, module_name: str) -> CpuQuantLinear | GGUFLinear | None:
        """The int4 layer of ``module_name``'s weight from its stored blocks (:data:`NATIVE_TYPES`), a GGUFLinear of
        them (:data:`BLOCK_TYPES`, with ``blocks``), or None where its type is neither, the kernels do not build
        here, or the shape does not tile."""
        if module_name not in self._built:
            fused = module_name.rsplit(".", 1)[-1] in STEP_FUSED  # (the fused matrix goes on huge pages instead)
            with hugepages.plain() if fused else nullcontext():
                self._built[module_name] = self._cpu_linear(module_name)
        return self._built[module_name]

    def _cpu_linear(self, module_name: str) -> CpuQuantLinear | GGUFLinear | None:
        info = self._tensor(module_name) if native_available() else None
        if info is None:
            return None
        kind = info.type.name
        if not (kind in NATIVE_TYPES or (self.blocks and kind in BLOCK_TYPES)) or len(info.shape) != 2:
            return None
        out_features, in_features = info.shape
        if in_features % (GROUP if kind in ("Q4_0", "Q4_1", "Q8_0") else K_BLOCK):
            return None
        raw = torch.from_numpy(np.ascontiguousarray(self.reader.files.read(info)))
        permute = self.reader.arch.rope_permuted and info.name.endswith(("attn_q.weight", "attn_k.weight"))
        cfg = self.reader.config
        heads = int(cfg["num_attention_heads" if "attn_q" in info.name else "num_key_value_heads"]
                    or cfg["num_attention_heads"]) if permute else 0

        def rows(t: torch.Tensor) -> torch.Tensor:
            return unpermute_rope_rows(t, heads).contiguous() if permute else t

        if kind in BLOCK_TYPES:  # the stored rows of blocks as they are (whole rows un-permuted)
            return GGUFLinear(rows(raw.view(out_features, -1)).contiguous(), kind, in_features)
        if kind == "Q4_0":  # the stored blocks re-laid out in one pass, no code unpacked
            packed = hugepages.empty((out_features, in_features // 2), torch.uint8)
            scales = hugepages.empty((out_features, in_features // GROUP), torch.float16)
            q4_0_to_q4z(rows(raw.view(out_features, -1)).contiguous(), packed, scales, library())
            matrix = Q4Matrix(packed, scales, torch.empty(0, dtype=torch.uint8), GROUP)  # Q4_F16Z8: from_q4_0's
        else:
            codes, d, m = (q4_1_codes if info.type.name == "Q4_1" else q4_k_codes)(raw)
            matrix = Q4Matrix(pack_q4(rows(codes)), group_rows(rows(d).float()), group_rows(rows(m).float()),
                              GROUP)
        return CpuQuantLinear(4, in_features, out_features, int4=matrix)
