"""The CPU int4 path's non-expert linear layers, quantized once at load (issue 21).

When the kernels resolve to ``cpu-int4`` (``device="cpu"``: an AWQ checkpoint, a GGUF file whose experts have CPU
kernels, MXFP4 experts on ``mxfp4.c``), :func:`quantize_decoder_linears`
replaces, in the built decoder, each module by a :class:`~moeflow.kernels.cpu.quant_linear.CpuQuantLinear`
(the 16-bit module is dropped, never held beside it):

* ``lm_head`` -> int8 per output channel (torch's ``_weight_int8pack_mm``): a quarter of its fp32 bytes, the
  largest single read of a CPU decode step. Error: weights within half a quantization step (~0.4% of the
  channel's largest weight); activations and logits rounded to bf16 (the kernel's dtype). Measured on the
  embedded model: logits within 2% (relative norm) of the fp32 reference, greedy tokens equal
  (tests/test_cpu_linears.py).
* ``lm_head_bits=4`` (asked for): int4 (group 128) with the top 16 logits recomputed from the int8 rows
  (:class:`~moeflow.kernels.cpu.lm_head.RefinedInt4LmHead`): ~18 MB read per token instead of 33 MB on the
  peer benchmark's model; the top logits and greedy tokens are the int8 head's, the other logits int4's
  (3-4% relative error on the embedded model).
* AWQ attention projections (checkpoints that publish them in 4-bit) -> torch's int4 CPU kernel with the
  same weights (:func:`~moeflow.kernels.cpu.quant_linear.awq_linear_cpu`), instead of dequantizing per call.
* 16-bit attention projections -> int8 by default (``attention_bits="auto"``: 8 on this path, as llama.cpp
  users run Q8_0; docs/cpu.md: held-out bits/byte of the embedded model 1.8845 against 1.8843 with fp32
  attention, and the decode speed beside llama.cpp), int4 (group 128) when asked (``attention_bits=4``), kept
  as stored with ``attention_bits=None``. Quantized, the model runs weights it was not evaluated with. gpt-oss's
  biased projections (:class:`~moeflow.families.gpt_oss_layers.SinkAttention`) likewise, their biases kept in fp32;
  a GGUF file's Q8_0 ones (``stored``, outside the fused step) run on the file's blocks under "auto"
  (``StoredLinears.exact_linear``: :class:`~moeflow.kernels.cpu.gguf.GGUFLinear`, the weights exactly; docs/cpu.md:
  the deviation measured on a synthetic gpt-oss).
* a GGUF file's attention projections stored in 4 bits (Q4_0, Q4_1, Q4_K; :mod:`~moeflow.engine.gguf_linears`)
  -> int4 group 32 with the file's own codes and scales, under ``attention_bits="auto"`` and ``4``: the file's
  bits, no second rounding (llama.cpp's weights); stored as Q8_0, Q5_K or Q6_K -> the file's blocks
  (:class:`~moeflow.kernels.cpu.gguf.GGUFLinear`) under ``"auto"`` (int4 g128 of their values under ``4``). k
  and v take it together or not at all (the CPU step fuses them into one matrix); q beside a k/v of another form
  runs as its own part of the step's q/k/v projection (``SplitLinear``): a file with Q4_0 q and o and Q8_0 k / v
  (llama.cpp's choice for 8-expert models) runs q and o in the file's Q4_0 and k / v on the file's Q8_0 blocks
  (int4 g128 of their values under ``4``). ``attention_bits=8`` re-quantizes them to int8 as
  asked; ``None`` keeps the dequantized values. The lm_head of a GGUF file (``stored``), where the file holds it
  as a K-quant (a Q4_K_M file's Q6_K ``output.weight``) or Q8_0 (llama.cpp's Q8_0 files; a gpt-oss file's at
  every file type), runs on its own blocks under ``lm_head_bits=8``
  (:class:`~moeflow.kernels.cpu.gguf.GGUFLinear`: the file's weights, never dequantized at load; activations int8
  per 256 features (K-quants) or 32 (Q8_0); Q6_K: 0.82 bytes per weight, 1.8-2.0 against 2.6 ms of CPU per token
  for the int8 head at 32000 x 1024, ``benchmarks/results/peers/s16/``); otherwise int8 of its dequantized
  values.

The embeddings stay as loaded: a lookup reads only the prompt's rows, so quantizing them saves RAM, not time.
Where moeflow's own CPU kernels build (:mod:`moeflow.kernels.cpu.native`), every module here runs them instead of
torch's (fp32 in and out, activations rounded to int8 per 32 features; embedded model: logits within 0.8% of
the fp32 reference, greedy tokens equal). ``kernels="torch"`` never comes here: it stays the exact fp32 reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import nn

from moeflow.families.gpt_oss_layers import SinkAttention
from moeflow.families.layers import Attention, AWQLinear
from moeflow.kernels.cpu import hugepages
from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.lm_head import RefinedInt4LmHead
from moeflow.kernels.cpu.native import library, native_available
from moeflow.kernels.cpu.q8_matrix import Q8Matrix
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, StoredLinears, awq_linear_cpu, quantize_linear_cpu
from moeflow.kernels.dispatch import uses_cpu_int4
from moeflow.kernels.repack import quantize_rows_int8_grouped_native

ATTENTION_BITS = (None, 8, 4, "auto")
AUTO_ATTENTION_BITS = 8  # "auto" (the default) on the CPU int4 path: int8 16-bit attention projections
LM_HEAD_BITS = (8, 4)  # 8: the default; 4: int4 with the top candidates recomputed in int8 (kernels/cpu/lm_head.py)
ATTENTION_GROUP = 128  # int4 group size for projections quantized at load (the AWQ default)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# fused by the CPU step into one matrix each (fuse_qkv, NativeMLP.of): made in plain memory here, the fused matrix
# on huge pages (kernels/cpu/hugepages.py: a dropped tensor among kept ones would stay resident in its chunk)
STEP_FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ATTENTION_MODULES = (Attention, SinkAttention)  # the attention modules whose PROJECTIONS are quantized here


def check_attention_bits(attention_bits: int | str | None, kernels_linear: str, lm_head_bits: int = 8) -> None:
    """ValueError unless ``attention_bits`` is "auto", None, 8 or 4 and ``lm_head_bits`` 8 or 4, 8 or 4 bits and
    a non-default head given only on the CPU int4 path (``lm_head_bits=4`` also needs moeflow's native CPU kernels)."""
    if lm_head_bits not in LM_HEAD_BITS:
        raise ValueError(f"lm_head_bits={lm_head_bits!r}: expected 8 or 4")
    if lm_head_bits != 8 and (not uses_cpu_int4(kernels_linear) or not native_available()):
        raise ValueError(f"lm_head_bits={lm_head_bits} runs the lm_head through moeflow's native CPU kernels on "
                         "the CPU int4 path (device='cpu', an AWQ checkpoint, a C compiler); here the linear "
                         f"layers run the {kernels_linear!r} kernels")
    if attention_bits not in ATTENTION_BITS:
        raise ValueError(f"attention_bits={attention_bits!r}: expected 'auto', None, 8 or 4")
    if attention_bits == "auto":
        return
    if attention_bits is not None and not uses_cpu_int4(kernels_linear):
        raise ValueError(f"attention_bits={attention_bits} quantizes 16-bit attention projections for the CPU "
                         "int4 path (device='cpu', an AWQ checkpoint, kernels 'auto' or 'cpu-int4'); here the "
                         f"linear layers run the {kernels_linear!r} kernels")


def resolve_attention_bits(attention_bits: int | str | None, kernels_linear: str, linear_attention: bool
                           ) -> int | None:
    """The bits 16-bit attention projections are quantized to at load (None: kept as stored). ``"auto"``:
    :data:`AUTO_ATTENTION_BITS` on the CPU int4 path for softmax-attention families, else None (the GPU paths,
    the torch reference, gated / linear-attention families keep their projections)."""
    if attention_bits != "auto":
        return attention_bits
    return AUTO_ATTENTION_BITS if uses_cpu_int4(kernels_linear) and not linear_attention else None


def quantized_as_stored(decoder: nn.Module, attention_bits: int | None, lm_head_bits: int = 8) -> frozenset[str]:
    """The parameter names (``lm_head.weight``, ``layers.0.self_attn.q_proj.weight``, ...) that
    :func:`quantize_decoder_linears` quantizes to int8 with :func:`quantize_rows_int8`, which takes them in the
    checkpoint's dtype: the loader need not widen them to fp32 first (``load_non_expert_weights(as_stored=)``)."""
    names = set()
    if not (lm_head_bits == 4 and getattr(decoder.lm_head, "bias", None) is None):
        names.add("lm_head.weight")
    if attention_bits == 8:
        for parent_name, parent in decoder.named_modules():
            if isinstance(parent, ATTENTION_MODULES):
                names.update(f"{parent_name}.{name}.weight" for name, child in parent.named_children()
                             if name in PROJECTIONS and type(child) is nn.Linear)
    return frozenset(names)


def quantize_decoder_linears(decoder: nn.Module, attention_bits: int | None, lm_head_bits: int = 8,
                             stored: StoredLinears | None = None) -> dict[str, int]:
    """Replace ``decoder``'s lm_head and attention projections in place (see the module docstring); ``stored``:
    the attention projections to take as the checkpoint stores them where it can (a GGUF file's Q4_0 / Q4_1 / Q4_K).

    Returns how many modules of each kind were replaced ({"lm_head", "awq", "attention", "stored"}: "stored" counts
    the lm_head too where it runs on the file's blocks).
    """
    counts = {"lm_head": 0, "awq": 0, "attention": 0, "stored": 0}
    if stored is not None:
        counts["stored"] = _take_stored(decoder, stored)
    head = _stored_head(decoder, stored, lm_head_bits)
    if head is not None:
        decoder.lm_head = head
        counts["stored"] += 1
    elif lm_head_bits == 4 and getattr(decoder.lm_head, "bias", None) is None:
        decoder.lm_head = RefinedInt4LmHead.quantize(decoder.lm_head.weight)
    else:
        decoder.lm_head = _with_bias(quantize_rows_int8(decoder.lm_head.weight), decoder.lm_head)
    counts["lm_head"] = 1
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            with hugepages.plain() if name in STEP_FUSED else nullcontext():
                new = _quantized(parent, name, child, attention_bits, counts)
            if new is not None:
                setattr(parent, name, _with_bias(new, child))
    return counts


def _quantized(parent: nn.Module, name: str, child: nn.Module, attention_bits: int | None,
               counts: dict[str, int]) -> CpuQuantLinear | None:
    """``parent.name`` (``child``) quantized for the CPU (:func:`quantize_decoder_linears`), or None (kept)."""
    if isinstance(child, AWQLinear) and _int4_shape_ok(child.in_features, child.out_features):
        counts["awq"] += 1
        return awq_linear_cpu(child.qweight, child.qzeros, child.scales, child.group_size)
    if attention_bits is not None and isinstance(parent, ATTENTION_MODULES) and name in PROJECTIONS \
            and type(child) is nn.Linear:
        new = _quantize_dense(child.weight, attention_bits)
        counts["attention"] += new is not None
        return new
    return None


def quantize_rows_int8(weight: torch.Tensor) -> CpuQuantLinear:
    """``quantize_linear_cpu(weight.float(), bits=8)``, bit for bit, from the weight ``[out, in]`` as stored
    (fp16, bf16 or fp32): each row is widened to fp32 in a row buffer, quantized and written into the kernel's
    row groups in one native pass (:func:`~moeflow.kernels.repack.quantize_rows_int8_grouped_native`), so
    neither an fp32 copy of the whole matrix nor a plain-row int8 copy is made (a Mixtral lm_head: 524 MB and
    131 MB written and faulted in at load). Where moeflow's kernels do not build (or ``in % 32``):
    :func:`quantize_linear_cpu`."""
    w = weight.detach()
    made = quantize_rows_int8_grouped_native(library(), w, torch.get_num_threads())
    if made is None:
        return quantize_linear_cpu(w.float(), bits=8)
    out_features, in_features = w.shape
    return CpuQuantLinear(8, in_features, out_features, int8=Q8Matrix(made[0], made[1].float()))


def _take_stored(decoder: nn.Module, stored: StoredLinears) -> int:
    """Put ``stored``'s layers in place of the dense attention projections that have one (:func:`_stored_groups`).
    Returns how many were replaced."""
    count = 0
    for _path, parent, names, olds, news in _stored_groups(decoder, stored):
        for n, old, new in zip(names, olds, news, strict=True):
            setattr(parent, n, _with_bias(new, old))
        count += len(names)
    return count


def stored_weight_names(decoder: nn.Module, stored: StoredLinears, lm_head_bits: int = 8) -> frozenset[str]:
    """The weights (``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``) that
    :func:`quantize_decoder_linears` with ``stored`` will replace by ``stored``'s layers: the loader need not read
    or dequantize them (``load_non_expert_weights(deferred=)``). Builds those layers once (``stored`` keeps them for
    the replacement)."""
    names = {f"{path}.{n}.weight" if path else f"{n}.weight"
             for path, _parent, group, _olds, _news in _stored_groups(decoder, stored) for n in group}
    if _stored_head(decoder, stored, lm_head_bits) is not None:
        names.add("lm_head.weight")
    return frozenset(names)


def _stored_head(decoder: nn.Module, stored: StoredLinears | None, lm_head_bits: int) -> nn.Module | None:
    return stored.lm_head() if stored is not None and lm_head_bits == 8 and \
        getattr(decoder.lm_head, "bias", None) is None else None


def _stored_groups(decoder: nn.Module, stored: StoredLinears) \
        -> Iterator[tuple[str, nn.Module, tuple[str, ...], list[nn.Module], list[CpuQuantLinear | GGUFLinear]]]:
    """(path, parent, names, old modules, ``stored``'s layers) for each group of dense attention projections
    ``stored`` has layers for: k and v together or neither (the CPU step fuses them into one matrix of one form;
    q beside them may be of another form: :class:`~moeflow.kernels.cpu.quant_linear.SplitLinear`); a sink
    attention's (gpt-oss) projections one by one, on the file's Q8_0 blocks (``stored.exact_linear``)."""
    for path, parent in list(decoder.named_modules()):
        if isinstance(parent, SinkAttention):  # (no fused step) each projection on the file's Q8_0 blocks
            for name in PROJECTIONS:
                old = getattr(parent, name)
                new = stored.exact_linear(f"{path}.{name}" if path else name) if type(old) is nn.Linear else None
                if new is not None:
                    yield path, parent, (name,), [old], [new]
            continue
        if not isinstance(parent, Attention):
            continue
        for names in (("q_proj",), ("k_proj", "v_proj"), ("o_proj",)):
            olds = [getattr(parent, n, None) for n in names]
            if not all(type(o) is nn.Linear for o in olds):
                continue
            news = [stored.cpu_linear(f"{path}.{n}" if path else n) for n in names]
            if any(n is None for n in news) or len({_form(n) for n in news}) != 1:
                continue
            yield path, parent, names, olds, news


def _form(layer: CpuQuantLinear | GGUFLinear) -> tuple:
    """What k and v must share to fuse into one matrix: a GGUF layer's block type, an int4 / int8 layer's form."""
    if isinstance(layer, GGUFLinear):
        return ("gguf", layer.type.name)
    return layer.bits, layer.group_size, layer.scales.dtype, layer.mins.numel() > 0


def _int4_shape_ok(in_features: int, out_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 32 == 0  # torch's int4 CPU kernel's tiling


def _quantize_dense(weight: torch.Tensor, bits: int) -> CpuQuantLinear | None:
    out_features, in_features = weight.shape
    if bits == 8:
        return quantize_rows_int8(weight)
    group = min(ATTENTION_GROUP, in_features)
    if not _int4_shape_ok(in_features, out_features) or in_features % group:
        return None  # the kernel cannot tile it: the projection stays 16-bit
    return quantize_linear_cpu(weight, bits=4, group_size=group)


def _with_bias(new: CpuQuantLinear | GGUFLinear, old: nn.Module) -> CpuQuantLinear | GGUFLinear:
    bias = getattr(old, "bias", None)
    if bias is not None:
        new.set_bias(bias)
    return new
