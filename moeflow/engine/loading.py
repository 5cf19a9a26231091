"""Turning a checkpoint into a model: non-expert weights into the decoder, experts into the expert backend.

Everything family-specific (tensor names, expert layouts) is asked of the :class:`~moeflow.families.Family`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from moeflow.engine.gguf_experts import q4_0_awq_expert_tensors
from moeflow.errors import CheckpointError
from moeflow.families import Family, family_for_config
from moeflow.families.base import ExpertLayout, ExpertSpec
from moeflow.families.layers import AWQLinear, Fp32Linear
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec, read_json
from moeflow.io.gguf import (
    ExpertBytes,
    ExpertConvert,
    GGUFExpertSource,
    GGUFModel,
    dense_expert_tensors,
)
from moeflow.io.gguf.biased import BiasedConvert, ExpertBiases
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.io.gguf.nextn import mtp_blocks, no_mtp_layers
from moeflow.io.gguf.reader import GGUFCheckpointReader
from moeflow.kernels.experts.mxfp4_reference import from_ggml_mxfp4
from moeflow.kernels.formats import (
    AWQFormat,
    BiasedAWQFormat,
    BiasedDenseFormat,
    BiasedExpertFormat,
    DenseFormat,
    ExpertFormat,
    MXFP4Format,
)
from moeflow.kernels.formats import gguf_expert_format as gguf_format_of_types
from moeflow.quant.fp8 import awq_expert_tensors, int4_group_size

# buffers that stay fp32 whatever the model's dtype: DeepSeek-V3's selection bias decides near-ties among
# sigmoid scores in [0, 1], which bf16's 8 bits of mantissa would flip (its checkpoints store it in fp32)
FP32_BUFFERS = ("e_score_correction_bias",)


def expert_format(family: Family, layout: ExpertLayout, quant: QuantizationSpec | None,
                  dtype: torch.dtype) -> ExpertFormat:
    """The slot format of one expert: AWQ bytes as stored, or dense weights in ``dtype``."""
    spec = family.expert_spec()
    if spec.activation != "silu" or spec.bias or layout.mxfp4:
        return biased_expert_format(spec, layout, quant, dtype)
    if layout.awq:
        if quant is None:
            raise CheckpointError("expert tensors are AWQ-quantized (qweight) but the checkpoint has no "
                                  "quantization_config in config.json nor a quant_config.json")
        return AWQFormat(spec.hidden_size, spec.intermediate_size, layout.scales_dtype, quant.group_size)
    return DenseFormat(spec.hidden_size, spec.intermediate_size, dtype)


def gguf_expert_format(family: Family, model: GGUFModel, dtype: torch.dtype, mtp: bool = False
                       ) -> tuple[ExpertFormat, ExpertConvert]:
    """The slot format of a GGUF model's experts, and the ``convert`` that turns an expert's bytes as stored
    (:class:`~moeflow.io.gguf.ExpertBytes`, read by :func:`gguf_expert_source`) into that format's tensors.

    * every expert Q4_0: the AWQ format (group 32, zero point 8, scale ``d``: the same 4-bit codes and fp16 scales,
      bit for bit the same weights), so the AWQ kernels (Triton, CPU int4, the fused MoE, CUDA graphs) run them;
    * otherwise the GGUF format (:class:`~moeflow.kernels.formats.gguf.GGUFFormat`): each expert's blocks as the
      file stores them, run by the GGUF Triton kernels (the torch reference off CUDA), ``convert`` handing the
      stored bytes through;
    * a mix the GGUF format cannot hold (more than two types in one projection, two types of the same row size):
      dequantized exactly (fp32, :mod:`moeflow.quant.ggml`) at load into the dense format of ``dtype``, with a
      warning naming the types;
    * biased experts (gpt-oss): :func:`gguf_biased_expert_format`.

    ``mtp``: the MTP layers' experts (blocks past the decoder's, :func:`~moeflow.io.gguf.nextn.mtp_blocks`) are
    read too, so their types count."""
    spec = family.expert_spec()
    if spec.activation != "silu" or spec.bias:
        return gguf_biased_expert_format(family, model, dtype)
    H, I = spec.hidden_size, spec.intermediate_size  # noqa: E741
    blocks = tuple(family.moe_layers) + (mtp_blocks(model.config) if mtp else ())
    if model.expert_types(blocks) == {"Q4_0"} and H % 32 == 0 and I % 32 == 0:
        return AWQFormat(H, I, torch.float16, 32), q4_0_awq_expert_tensors
    types = model.projection_types(blocks)
    try:
        return gguf_format_of_types(types["gate"] | types["up"], types["down"], H, I, dtype), stored_expert_tensors
    except ValueError as e:
        warnings.warn(f"{model.path}: experts {types} dequantized into {dtype} at load ({e})", stacklevel=2)
        return DenseFormat(H, I, dtype), dense_expert_tensors


def gguf_biased_expert_format(family: Family, model: GGUFModel, dtype: torch.dtype
                              ) -> tuple[BiasedExpertFormat, ExpertConvert]:
    """gpt-oss's GGUF experts (biases, clamped SwiGLU; :mod:`moeflow.io.gguf.biased`): every expert MXFP4 -> the MXFP4
    format, the blocks reshuffled into the published layout (bit for bit the same weights); every expert Q4_0 (a
    requantized file) -> the biased AWQ format (Q4_0's codes and fp16 scales as AWQ's, bit for bit), when the biases
    are exact in its fp16; float or other ggml types -> dequantized exactly (fp32) into the biased dense format of
    ``dtype`` (a warning names quantized types and why).
    The biases (``ffn_{gate,up,down}_exps.bias``) are read from the file beside each expert."""
    spec = family.expert_spec()
    H, I = spec.hidden_size, spec.intermediate_size  # noqa: E741
    if not spec.bias:
        raise CheckpointError(f"{model.path}: {family.name}'s experts ({spec.activation} without biases) are not read "
                              "from GGUF files (gated SiLU experts, or gpt-oss's biased clamped SwiGLU)")
    kw = dict(activation=spec.activation, bias=True, swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit)
    biases = ExpertBiases(model.files, I, H)
    types = model.expert_types(tuple(family.moe_layers))
    if types == {"MXFP4"}:
        return MXFP4Format(H, I, dtype, 32, **kw), BiasedConvert(mxfp4_expert_tensors, biases)
    why = "only MXFP4 and Q4_0 are kept as stored for biased experts"
    if types == {"Q4_0"} and H % 32 == 0 and I % 32 == 0:  # the AWQ codes and fp16 scales, biases in fp16
        if biases.exact_in(torch.float16, tuple(family.moe_layers)):
            return BiasedAWQFormat(H, I, torch.float16, 32, **kw), BiasedConvert(q4_0_awq_expert_tensors, biases)
        why = "the biased AWQ format holds the biases in its scales' fp16, which does not hold these exactly"
    if types - {"F32", "F16", "BF16"}:
        warnings.warn(f"{model.path}: {family.name} experts of types {sorted(types)} dequantized into {dtype} at "
                      f"load ({why})", stacklevel=3)
    return BiasedDenseFormat(H, I, dtype, **kw), BiasedConvert(dense_expert_tensors, biases)


def mxfp4_expert_tensors(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF MXFP4 experts as the MXFP4 format's tensors (published layout, gate rows then up; a byte shuffle by
    :func:`~moeflow.kernels.experts.mxfp4_reference.from_ggml_mxfp4`, bit for bit the same weights): ``w13_blocks``
    uint8 [2I, H/32, 16], ``w13_scales`` uint8 [2I, H/32], ``w2_blocks`` [H, I/32, 16], ``w2_scales`` [H, I/32].
    raw: "gate" / "up" / "down" -> uint8 [out, in/32 * 17] as stored."""
    parts = {}
    for p, s in expert.slices.items():
        if s.type.name != "MXFP4":
            raise CheckpointError(f"{s.path}: {s.tensor} is {s.type.name}, not MXFP4")
        parts[p] = from_ggml_mxfp4(raw[p])
    return {"w13_blocks": torch.cat([parts["gate"][0], parts["up"][0]], dim=0),
            "w13_scales": torch.cat([parts["gate"][1], parts["up"][1]], dim=0),
            "w2_blocks": parts["down"][0], "w2_scales": parts["down"][1]}


def stored_expert_tensors(expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF format's loader form is the expert's bytes as stored ("gate" / "up" / "down" -> uint8 [out,
    row_bytes], views of the reader's staging buffer, written into a region before the next read)."""
    return raw


def gguf_expert_source(model: GGUFModel, family: Family, convert: ExpertConvert,
                       extra_layers: int = 0) -> GGUFExpertSource:
    """Every expert of the GGUF model by MoE layer (the family's MoE layers are GGUF blocks ``blk.N``), then the
    ``extra_layers`` MTP layers' (MoE layers ``len(moe_layers) + j``: blocks ``blk.{num_hidden_layers + j}``)."""
    spec = family.expert_spec()
    blocks = tuple(family.moe_layers) + mtp_blocks(model.config)[:extra_layers]
    if len(blocks) != len(family.moe_layers) + extra_layers:
        raise CheckpointError(f"{model.path}: {extra_layers} multi-token-prediction MoE layer(s) asked, but the file "
                              f"has {len(mtp_blocks(model.config))} MTP block(s)")
    return model.expert_source(blocks, family.num_experts, spec.hidden_size, spec.intermediate_size, convert)


def biased_expert_format(spec: ExpertSpec, layout: ExpertLayout, quant: QuantizationSpec | None,
                         dtype: torch.dtype) -> BiasedExpertFormat:
    """Experts with biases / another activation / MXFP4 storage (gpt-oss): :mod:`moeflow.kernels.formats.biased`."""
    kw = dict(activation=spec.activation, bias=spec.bias, swiglu_alpha=spec.swiglu_alpha,
              swiglu_limit=spec.swiglu_limit)
    H, I = spec.hidden_size, spec.intermediate_size  # noqa: E741
    if layout.mxfp4 or layout.awq:
        want = "mxfp4" if layout.mxfp4 else "awq"
        if quant is None or ("awq" if quant.awq_layout else quant.method) != want:
            found = "no quantization_config" if quant is None else f"quant_method {quant.method!r}"
            raise CheckpointError(f"expert tensors are {want.upper()}-quantized but config.json has {found} "
                                  f"(expected quantization_config.quant_method {want!r})")
        if layout.mxfp4:  # biases in the model dtype (exact for the published bf16 biases)
            return MXFP4Format(H, I, dtype, 32, **kw)
        return BiasedAWQFormat(H, I, layout.scales_dtype, quant.group_size, **kw)
    return BiasedDenseFormat(H, I, dtype, **kw)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "constant_", "zeros_", "ones_", "orthogonal_")


@contextlib.contextmanager
def skipped_weight_init() -> Iterator[None]:
    """Modules built inside keep their parameters uninitialized (``torch.empty``'s bytes): the random
    initialization of ``nn.Linear`` / ``nn.Embedding`` (seconds for a vocabulary-sized matrix) is skipped, as
    every parameter is then overwritten from the checkpoint by :func:`load_non_expert_weights`, which refuses a
    checkpoint that lacks one. (``transformers``' ``no_init_weights`` does the same.) Not for concurrent use
    with code that relies on ``torch.nn.init`` in other threads."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}

    def skip(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return tensor

    try:
        for name in saved:
            setattr(torch.nn.init, name, skip)
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.nn.init, name, f)


def load_non_expert_weights(
    decoder: nn.Module, reader: CheckpointReader, family: Family, layout: ExpertLayout,
    device: torch.device, dtype: torch.dtype, as_stored: frozenset[str] = frozenset(),
    deferred: frozenset[str] = frozenset(), mapping: MappedGGUF | None = None,
) -> None:
    """Fill every parameter/buffer of ``decoder`` from the checkpoint, checking shapes against config.json.
    ``as_stored``: names (``lm_head.weight``) kept in the checkpoint's dtype, for a caller that quantizes them
    next (an fp32 copy of a vocabulary-sized matrix is half a gigabyte written and dropped). ``deferred``: names
    neither read nor dequantized, left on the meta device, for a caller that replaces their modules next by layers
    built from the checkpoint's stored blocks (:func:`~moeflow.engine.cpu_linears.stored_weight_names`).
    ``mapping``: a GGUF's as-stored float weights are views of it (:meth:`GGUFCheckpointReader.stored_float`)."""
    tie = bool(getattr(family.config, "tie_word_embeddings", False))
    for module_name, module in decoder.named_modules():
        if module_name == "rotary":
            continue
        for pname, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{pname}"
            if full in deferred:  # (an nn.Linear's weight: its module is replaced next)
                meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                setattr(module, pname, nn.Parameter(meta, requires_grad=False) if isinstance(tensor, nn.Parameter)
                        else meta)
                continue
            ckpt = family.checkpoint_name(full, layout)
            if full == "lm_head.weight" and ckpt not in reader and tie:
                ckpt = family.checkpoint_name("embed_tokens.weight", layout)
            src = reader.stored_float(ckpt, tuple(tensor.shape), mapping) \
                if full in as_stored and isinstance(reader, GGUFCheckpointReader) else None
            if src is None:
                src = reader.get(ckpt, tuple(tensor.shape))
            # (an Fp32Linear keeps the dtype it was built in: DSA's fp32 weights_proj)
            keep = isinstance(module, (AWQLinear, Fp32Linear)) or pname in FP32_BUFFERS
            target_dtype = src.dtype if full in as_stored and src.is_floating_point() else \
                tensor.dtype if keep else dtype
            with torch.no_grad():
                tensor.data = src.to(device=device, dtype=target_dtype)


def load_mtp(reader: CheckpointReader, family: Family, layout: ExpertLayout, device: torch.device,
             dtype: torch.dtype, source: str) -> MultiTokenPredictor:
    """The family's multi-token-prediction layers with their non-expert weights loaded (dense linears: the MTP
    layer is one layer, its attention is not quantized at load). CheckpointError naming the config field when
    config.json declares none, or the first missing tensor when the checkpoint lacks them (a checkpoint saved by
    transformers drops them)."""
    field = family.mtp_config_field
    gguf = reader if isinstance(reader, GGUFCheckpointReader) else None
    if field is None or family.num_mtp_layers() == 0:
        if gguf is not None:
            raise CheckpointError(no_mtp_layers(gguf.source, gguf.files.architecture, gguf.files.metadata))
        what = f"{field}={family.num_mtp_layers()}" if field else f"the {family.name} family has no such layers"
        raise CheckpointError(f"{source}: mtp=True but the model has no multi-token-prediction layers ({what})")
    try:
        mtp = family.build_mtp(dtype, lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias=bias,
                                                                                       dtype=dtype))
    except NotImplementedError as e:
        raise CheckpointError(f"{source}: mtp=True: {e}") from None
    for name, tensor in list(mtp.named_parameters()) + list(mtp.named_buffers()):
        ckpt = family.mtp_checkpoint_name(name, layout)
        if ckpt not in reader and gguf is not None:
            stored = gguf.gguf_name(ckpt)
            raise CheckpointError(f"{gguf.source}: mtp=True but the multi-token-prediction tensor "
                                  f"{stored[0] if stored else ckpt!r} ({ckpt}) is missing "
                                  f"({gguf.files.architecture}.nextn_predict_layers={family.num_mtp_layers()}); "
                                  "load with mtp=False")
        if ckpt not in reader:
            raise CheckpointError(f"{reader.directory}: mtp=True but the multi-token-prediction tensor {ckpt!r} is "
                                  f"missing ({field}={family.num_mtp_layers()} in {source}); load with mtp=False")
        src = reader.get(ckpt, tuple(tensor.shape))
        with torch.no_grad():
            tensor.data = src.to(device=device, dtype=tensor.dtype if name.endswith(FP32_BUFFERS) else dtype)
    return mtp


def mtp_moe_layers(mtp: MultiTokenPredictor | None) -> int:
    """MoE layers the MTP module adds to the expert backend (0 without one)."""
    return 0 if mtp is None else len(mtp.moe_blocks)


def detect_awq_attention(reader: CheckpointReader, family: Family, layout: ExpertLayout,
                         quant: QuantizationSpec | None) -> dict | None:
    """{group_size, scales_dtype} when the attention projections are AWQ 4-bit, else None."""
    probe = family.checkpoint_name("layers.0.self_attn.q_proj.qweight", layout)
    if probe not in reader:
        return None
    if quant is None:
        raise CheckpointError("attention tensors are AWQ-quantized (qweight) but the checkpoint has no "
                              "quantization_config")
    scales = reader.get(family.checkpoint_name("layers.0.self_attn.q_proj.scales", layout))
    return {"group_size": quant.group_size, "scales_dtype": scales.dtype}


def keep_dense_linears(decoder: nn.Module, reader: CheckpointReader, family: Family, layout: ExpertLayout,
                       dtype: torch.dtype) -> None:
    """Make every AWQ linear of ``decoder`` whose module the checkpoint stores 16-bit (a compressed-tensors
    ``ignore`` entry: shared experts or linear attention left unquantized) a dense ``nn.Linear`` of ``dtype``,
    before the weights are loaded."""
    for name, module in list(decoder.named_modules()):
        if isinstance(module, AWQLinear) and family.checkpoint_name(f"{name}.qweight", layout) not in reader \
                and family.checkpoint_name(f"{name}.weight", layout) in reader:
            parent, _, leaf = name.rpartition(".")
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
            setattr(decoder.get_submodule(parent), leaf, dense)


def iter_experts(
    reader: CheckpointReader, family: Family, layout: ExpertLayout, quant: QuantizationSpec | None, progress: bool,
    extra_layers: int = 0,
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield (MoE layer index, expert, tensors) one expert at a time, with a progress bar on large checkpoints.
    ``extra_layers``: MoE layers past the decoder's (the MTP layers', :func:`mtp_moe_layers`)."""
    n_moe, n_exp = len(family.moe_layers) + extra_layers, family.num_experts
    bar = tqdm(total=n_moe * n_exp, desc="loading experts", unit="expert", disable=not progress)
    try:
        for moe_layer in range(n_moe):
            for expert in range(n_exp):
                yield moe_layer, expert, family.read_expert(reader, layout, quant, moe_layer, expert)
                bar.update(1)
    finally:
        bar.close()


def requantized_expert_format(family: Family) -> ExpertFormat:
    """The int4 (AWQ, fp16 scales) format dense-read experts are requantized into (FP8 checkpoints)."""
    spec = family.expert_spec()
    group = int4_group_size(spec.hidden_size, spec.intermediate_size)
    return AWQFormat(spec.hidden_size, spec.intermediate_size, torch.float16, group)


def requantize_experts(experts: Iterator[tuple[int, int, dict[str, torch.Tensor]]], fmt: ExpertFormat
                       ) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Dense experts (``w13``/``w2``) -> AWQ expert tensors of ``fmt`` (round-to-nearest), one at a time."""
    for moe_layer, expert, tensors in experts:
        yield moe_layer, expert, awq_expert_tensors(tensors["w13"], tensors["w2"], fmt.group_size, fmt.dtype)


def non_expert_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, shared storage once (tied weights, views of a fused matrix)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for i, t in enumerate(list(model.parameters()) + list(model.buffers())):
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" and t.numel() else -1 - i
        groups.setdefault(key, []).append(t)
    total = 0
    for ts in groups.values():
        size = sum(t.numel() * t.element_size() for t in ts)
        total += size if len(ts) == 1 else min(size, ts[0].untyped_storage().nbytes())
    return total


def read_routers(directory: str | Path) -> tuple[list[torch.Tensor], int]:
    """(router weight fp32 [E, H] of every MoE layer, top-k) of an HF-layout checkpoint directory, reading no
    expert weight (skip-gate predictors, the simulator's ``--gates``). The family names the tensors."""
    directory = Path(directory)
    family = family_for_config(read_json(directory / "config.json"), str(directory / "config.json"))
    reader = CheckpointReader(directory)
    try:
        layout = family.detect_expert_layout(reader)
        with torch.device("meta"):  # module paths and shapes only: nothing is allocated
            decoder = family.build_decoder(torch.float32,
                                           lambda _n, fan_in, fan_out, bias=False: nn.Linear(fan_in, fan_out, bias))
        paths = {id(m): name for name, m in decoder.named_modules()}
        weights = [
            reader.get(family.checkpoint_name(f"{paths[id(block)]}.gate.weight", layout),
                       tuple(block.gate.weight.shape)).float()
            for block in decoder.moe_blocks
        ]
    finally:
        reader.close()
    return weights, family.router_spec().top_k
