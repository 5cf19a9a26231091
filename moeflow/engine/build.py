"""The one place a model gets assembled: checkpoint -> family -> decoder + expert backend, kernels resolved once.

Order: read config.json and pick the family; detect the expert layout and format; resolve the kernel
choice (``resolve_kernels``: the only place it is decided, errors instead of silent rewrites); build the
decoder and load its weights; build the expert backend (:func:`make_expert_backend`) and load every
expert into it; ``finish_loading``. The result is a :class:`BuiltModel` the API class wraps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.engine import loading, memory
from moeflow.engine.cpu_form_cache import cached_load
from moeflow.engine.cpu_layers import native_layers
from moeflow.engine.cpu_linears import (
    check_attention_bits,
    quantize_decoder_linears,
    quantized_as_stored,
    resolve_attention_bits,
    stored_weight_names,
)
from moeflow.engine.cpu_step import fuse_cpu_step
from moeflow.engine.gguf_experts import DirectQ4_0Load, q4_0_direct_applies
from moeflow.engine.gguf_linears import GGUFStoredLinears
from moeflow.engine.mapped_experts import MappedGGUFExperts, mapped_experts_apply
from moeflow.engine.parallel_load import ExpertLoad, load_experts, show_progress
from moeflow.engine.sampling import GenerationConfig
from moeflow.engine.stored_embedding import use_stored_embedding
from moeflow.errors import SchedulingError
from moeflow.families import Family, family_for_config
from moeflow.families.base import CausalDecoder
from moeflow.families.gated_deltanet import GatedDeltaNet
from moeflow.families.layers import AWQLinear, fuse_qkv_projections
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.io.checkpoint import CheckpointReader, open_checkpoint, read_json, read_quantization, resolve_checkpoint
from moeflow.io.expert_index import ExpertIndex
from moeflow.io.gguf import open_gguf, resolve_gguf
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.io.tokenizer import Tokenizer
from moeflow.kernels.cpu import native as cpu_native
from moeflow.kernels.dispatch import CPU_INT4, uses_cpu_int4, uses_triton
from moeflow.kernels.formats import ExpertFormat, GGUFFormat, MXFP4Format
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.resident import CpuInt4Experts
from moeflow.offload import Stats, create_expert_backend, get_policy, min_slots
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.cpu_slots import CpuInt4Format
from moeflow.offload.host_store import HostStore
from moeflow.offload.platform import real_host_store
from moeflow.offload.predictors.base import PredictorMismatchError
from moeflow.offload.units import format_bytes
from moeflow.quant.fp8 import Fp8BlockReader, awq_expert_tensors, fp8_block_spec

KERNEL_CHOICES = ("auto", "torch", "triton", "cpu-int4")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The resolved kernel choice: ``experts`` for the expert backend, ``linear`` for AWQ attention layers."""

    choice: str  # what the model reports: "torch", "triton" or "cpu-int4"
    experts: str
    linear: str


def resolve_kernels(kernels: str, device: torch.device, awq: bool) -> Kernels:
    """auto: Triton on CUDA; on the CPU torch's int4 kernels for AWQ experts, else the torch reference.

    "cpu-int4" (asked for, or chosen by "auto") computes AWQ experts on the CPU with torch's int4 kernels:
    resident ones in ``CpuInt4Experts``, offloaded ones in slots that hold the same int4 form
    (:mod:`moeflow.offload.cpu_slots`, see :func:`expert_storage_format`). Formats the int4 form cannot hold
    (biases, clamped activations, MXFP4: ``awq=False``) keep the torch reference. The lm_head and the AWQ
    attention projections run quantized CPU kernels (``linear="cpu-int4"``, :mod:`moeflow.engine.cpu_linears`).
    GGUF experts of types with CPU kernels (Q8_0, Q4_K, Q5_K, Q6_K) get them from ``build_model`` under "auto" on
    the CPU (``GGUFFormat.with_cpu_kernels``, reported as "cpu-int4" with the same quantized linears); MXFP4
    experts get the native MXFP4 kernel (``MXFP4Format.with_cpu_kernels``, reported as "cpu-int4" likewise: the
    lm_head and the biased attention projections int8 under ``attention_bits="auto"``).
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}: expected one of {KERNEL_CHOICES}")
    from moeflow.kernels.cpu.int4 import int4_cpu_available

    if kernels == "auto":
        if device.type == "cuda":
            kernels = "triton"
        else:
            kernels = "cpu-int4" if awq and int4_cpu_available() else "torch"
    elif kernels == "cpu-int4":
        if device.type != "cpu" or not awq:
            raise ValueError("kernels='cpu-int4' computes AWQ experts on the CPU: it needs device='cpu' and an AWQ "
                             "checkpoint")
        if not int4_cpu_available():
            raise ValueError("kernels='cpu-int4': this torch build lacks the int4 CPU kernels "
                             "(_weight_int4pack_mm_for_cpu); use kernels='torch'")
    if kernels == "triton" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on the CPU means its interpreter
    return Kernels(kernels, kernels, kernels)


def expert_storage_format(fmt: ExpertFormat, kernels: Kernels, offload: OffloadConfig) -> ExpertFormat:
    """The layout the expert backend stores and moves experts in: with the CPU int4 kernels and an offloading
    policy, torch's int4 form (``CpuInt4Format``: converted once at load, a miss copies the bytes the slot
    computes with); otherwise ``fmt`` itself (the GPU kernels' layout)."""
    if uses_cpu_int4(kernels.experts) and offload.policy != "resident":
        return CpuInt4Format.of(fmt)
    return fmt


def make_expert_backend(
    offload: OffloadConfig, kernels: Kernels, *, fmt: ExpertFormat, family: Family, decoder: CausalDecoder,
    device: torch.device, reserved_bytes: int, stats: Stats, checkpoint_dir: Path, expert_source=None,
    host_reserved_bytes: int = 0, mtp: MultiTokenPredictor | None = None, host_store: HostStore | None = None,
) -> ExpertBackend:
    """``CpuInt4Experts`` for resident experts computed with the CPU int4 kernels; otherwise the offload
    package's backend for ``offload.policy`` (``ResidentExperts`` for "resident"). ``mtp``: the MTP layers,
    whose MoE blocks are the backend's last layers."""
    blocks = decoder.moe_blocks + (mtp.moe_blocks if mtp is not None else [])
    num_moe = len(blocks)
    if uses_cpu_int4(kernels.experts) and offload.policy == "resident":
        return CpuInt4Experts(fmt, num_moe, family.num_experts)
    return create_expert_backend(
        offload, fmt=fmt, num_layers=num_moe, num_experts=family.num_experts,
        top_k=family.router_spec().top_k, device=device, kernels_backend=kernels.experts,
        gates=[block.gate for block in blocks], route=blocks[0].route, reserved_bytes=reserved_bytes,
        stats=stats, checkpoint_dir=checkpoint_dir, expert_source=expert_source,
        host_reserved_bytes=host_reserved_bytes, host_store=host_store,
    )


@dataclass
class BuiltModel:
    """Everything ``from_pretrained`` assembles."""

    family: Family
    decoder: CausalDecoder
    backend: ExpertBackend
    stats: Stats
    generation_config: GenerationConfig
    tokenizer: Tokenizer | None
    kernels: Kernels
    device: torch.device
    dtype: torch.dtype
    memory_plan: memory.MemoryPlan
    offload: OffloadConfig  # the caller's, or the one chosen for it (default_offload)
    mtp: MultiTokenPredictor | None = None  # the multi-token-prediction layers, when asked for (mtp=True)


def build_model(
    path_or_id: str | os.PathLike, *, device: torch.device, dtype: torch.dtype, offload: OffloadConfig | None,
    kernels: str, revision: str | None, progress: bool | None, families: tuple[type[Family], ...] | None = None,
    attention_bits: int | str | None = "auto", lm_head_bits: int = 8, cuda_graphs: bool = False,
    mtp: bool = False, gguf_file: str | None = None, mmap: bool = True, cpu_form_cache: bool = False,
) -> BuiltModel:
    """Load the checkpoint ``path_or_id`` (directory or hub id; or a GGUF model: a ``.gguf`` file, a directory
    holding one, a split set's first part, or ``gguf_file`` in a directory / hub repository).
    ``families``: accept only these (else ValueError).
    ``cuda_graphs``: the decode step will be captured, so the memory plan reserves its graphs' pools.
    ``attention_bits``: quantize 16-bit attention projections at load (CPU int4 path only; "auto": int8 there,
    kept elsewhere; a GGUF file's Q4_0 / Q4_1 / Q4_K projections keep the file's codes under "auto" and 4; see
    cpu_linears); ``lm_head_bits``: 8 (default) or 4 (CPU int4 path only, see cpu_linears).
    ``mtp``: also read the multi-token-prediction layers (:mod:`moeflow.families.mtp`; CheckpointError naming the
    config field or the missing tensor when the checkpoint has none); their experts join the backend after the
    decoder's. ``mmap``: GGUF experts computed on the CPU as the file stores them, resident on ``device="cpu"``,
    are views of the mapped file (:class:`~moeflow.engine.mapped_experts.MappedGGUFExperts`), not copies, and the
    embedding's rows are dequantized from it when looked up (:mod:`moeflow.engine.stored_embedding`).
    ``cpu_form_cache``: resident CPU int4 experts converted once, then mapped (:mod:`moeflow.engine.cpu_form_cache`)."""
    gguf_path = resolve_gguf(path_or_id, gguf_file, revision)
    gguf = open_gguf(gguf_path) if gguf_path is not None else None
    if gguf is None:
        directory = resolve_checkpoint(path_or_id, revision)
        config_path = directory / "config.json"
        raw_config = read_json(config_path)
    else:  # the GGUF metadata as the family's config.json
        directory, config_path, raw_config = gguf.directory, gguf.path, gguf.config
    model_type = raw_config.get("model_type")
    if families is not None and (model_type or "mixtral") not in {t for f in families for t in f.model_types}:
        raise ValueError(f"{config_path}: model_type {model_type!r} is not a "
                         f"{' or '.join(f.name.capitalize() for f in families)}")
    family = family_for_config(raw_config, str(config_path))
    fp8 = None if gguf else fp8_block_spec(raw_config, config_path)  # FP8 block-scaled (DeepSeek-V3): dequantized
    quant = None if fp8 or gguf else read_quantization(directory, raw_config)
    reader = gguf.reader if gguf else open_checkpoint(directory, quant)
    if fp8 is not None:
        reader = Fp8BlockReader(reader, fp8)
    early: ExpertLoad | None = None
    direct: DirectQ4_0Load | None = None  # an all-Q4_0 GGUF's experts straight into the CPU int4 form
    try:
        layout = family.detect_expert_layout(reader)
        convert = None
        if gguf is not None:  # the GGUF experts' format, and how a read turns their bytes into its tensors
            fmt, convert = loading.gguf_expert_format(family, gguf, dtype, mtp)
        else:
            fmt = loading.expert_format(family, layout, quant, dtype)
        if fp8 is not None:  # FP8 experts become int4 (AWQ) experts
            fmt = loading.requantized_expert_format(family)
        resolved = resolve_kernels(kernels, device,
                                   fmt.cpu_int4)  # cpu-int4: plain AWQ experts only
        if isinstance(fmt, GGUFFormat) and kernels == "auto" and device.type == "cpu" and fmt.cpu_unsupported() is None:
            # GGUF Q4_0/Q8_0/Q4_K/Q5_K/Q6_K experts on moeflow.kernels.cpu.gguf, the linears on the CPU kernels as AWQ's
            fmt = fmt.with_cpu_kernels()
            resolved = Kernels(CPU_INT4, resolved.experts, CPU_INT4)
        elif isinstance(fmt, MXFP4Format) and kernels == "auto" and device.type == "cpu" \
                and cpu_native.native_available():
            fmt = fmt.with_cpu_kernels()  # MXFP4 experts on the CPU: mxfp4.c on the slots' bytes
            resolved = Kernels(CPU_INT4, resolved.experts, CPU_INT4)  # the linears on the CPU kernels (cpu_linears)
        check_attention_bits(attention_bits, resolved.linear, lm_head_bits)
        keep_stored = gguf is not None and attention_bits in ("auto", 4)  # a GGUF's 4-bit attention: the file's bits
        stored_blocks = attention_bits == "auto"  # and its Q8_0 / Q5_K / Q6_K attention on the file's blocks
        attention_bits = resolve_attention_bits(attention_bits, resolved.linear,
                                                family.kv_cache_spec().linear is not None)
        if attention_bits is not None and family.kv_cache_spec().linear is not None:
            raise ValueError(f"attention_bits={attention_bits}: {family.name}'s gated attention and linear-attention "
                             "projections are not quantized at load; leave attention_bits unset")
        awq_attention = loading.detect_awq_attention(reader, family, layout, quant)
        mapping = MappedGGUF() if mmap and gguf is not None and device.type == "cpu" else None
        progress = show_progress(progress, fmt.nbytes * len(family.moe_layers) * family.num_experts)
        if gguf is None and fp8 is None and not mtp:  # the experts load while the rest is built (ExpertLoad)
            early = early_expert_load(offload, fmt, resolved, family, reader, layout, quant, device, progress)
        elif gguf is not None and not mtp and q4_0_direct_applies(convert, offload and offload.policy,
                                                                  uses_cpu_int4(resolved.experts), device):
            direct = DirectQ4_0Load(fmt, len(family.moe_layers), family.num_experts, loading.gguf_expert_source(
                gguf, family, convert), mapping, progress, start=not cpu_form_cache)
        with loading.skipped_weight_init():  # every parameter is read from the checkpoint below
            decoder = family.build_decoder(dtype, _linear_factory(dtype, awq_attention))
        if mapping is not None:  # the embedding's rows dequantized when looked up, from the mapped file
            use_stored_embedding(decoder, gguf, family.checkpoint_name("embed_tokens.weight", layout), dtype, mapping)
        if awq_attention is not None:
            loading.keep_dense_linears(decoder, reader, family, layout, dtype)
        # the CPU int4 path quantizes the lm_head (and 16-bit attention) to int8 from the checkpoint's dtype
        as_stored = quantized_as_stored(decoder, attention_bits, lm_head_bits) if uses_cpu_int4(resolved.linear) \
            else frozenset()
        stored = GGUFStoredLinears(gguf.reader, lambda m: family.checkpoint_name(f"{m}.weight", layout),
                                   blocks=stored_blocks) \
            if keep_stored and uses_cpu_int4(resolved.linear) else None
        # the weights taken as the file's blocks below (lm_head, 4-bit attention): never read nor dequantized
        deferred = stored_weight_names(decoder, stored, lm_head_bits) if stored is not None else frozenset()
        loading.load_non_expert_weights(decoder, reader, family, layout, device, dtype, as_stored, deferred, mapping)
        mtp_module = loading.load_mtp(reader, family, layout, device, dtype, str(config_path)) if mtp else None
        if uses_cpu_int4(resolved.linear):
            quantize_decoder_linears(decoder, attention_bits, lm_head_bits, stored)
            fuse_cpu_step(decoder, dtype)
            decoder.set_layers_step(native_layers(decoder))  # one-token steps: every layer in one native call
        for module in decoder.modules():
            if isinstance(module, AWQLinear):  # what the CPU kernels cannot tile stays on the torch reference
                module.use_kernels("torch" if uses_cpu_int4(resolved.linear) else resolved.linear)
            elif isinstance(module, GatedDeltaNet):  # the linear-attention layers follow the kernel choice
                module.use_kernels("triton" if uses_triton(resolved.choice, device) else "torch")
        fuse_qkv_projections(decoder)  # packed (Triton) AWQ q/k/v: one launch per layer instead of three
        decoder.rotary.to(device)

        stats = Stats()
        cfg = family.config
        non_expert = loading.non_expert_bytes(decoder)
        extra = loading.mtp_moe_layers(mtp_module)  # the MTP layers' MoE layers (and their other weights)
        if mtp_module is not None:
            non_expert += loading.non_expert_bytes(mtp_module)
        planned = None
        if offload is None:  # from_pretrained without an OffloadConfig: resident if it fits, else offload
            offload, planned = default_offload(family, fmt, device, dtype, non_expert, str(directory), cuda_graphs,
                                               extra)
        stored = early.store.fmt if early is not None else expert_storage_format(fmt, resolved, offload)
        if planned is None or stored is not fmt:  # (default_offload's plan is reused when the format is the same)
            planned = plan_memory(offload, family, stored, device, dtype, non_expert, cuda_graphs, extra)
        plan, sized = planned
        source = early.index if early is not None else None
        if early is direct is None and (offload.host_memory_gb is not None or offload.background_load or fp8 is None):
            if gguf is not None:  # (FP8: one by one below)
                source = loading.gguf_expert_source(gguf, family, convert, loading.mtp_moe_layers(mtp_module))
            else:
                source = open_expert_index(reader, family, layout, quant, fmt if fp8 is not None else None,
                                           len(family.moe_layers) + loading.mtp_moe_layers(mtp_module))
        host_reserved = plan.non_expert + plan.kv_cache if device.type == "cpu" else 0  # weights in host memory
        mapped = mapping is not None and source is not None and mapped_experts_apply(sized, stored, device)
        try:
            if mapped:  # the experts' CPU forms are views of the mapped file: nothing to read or copy
                backend = MappedGGUFExperts(stored, source, resolved.experts, mapping)
            elif direct is not None:
                backend = direct.backend
            else:
                backend = make_expert_backend(
                    sized, resolved, fmt=stored, family=family, decoder=decoder, device=device,
                    reserved_bytes=memory.reserved_device_bytes(plan), stats=stats, checkpoint_dir=directory,
                    expert_source=source, host_reserved_bytes=host_reserved, mtp=mtp_module,
                    host_store=early.store if early is not None else None,
                )
        except SchedulingError as e:
            if source is not None and early is None:  # (early's index: closed below, once its loader stopped)
                source.close()
            if mtp_module is not None and isinstance(e.__cause__, PredictorMismatchError):
                raise SchedulingError(
                    f"{e}. from_pretrained(mtp=True) adds the multi-token-prediction layers' experts to the expert "
                    f"backend as MoE layer(s) {len(family.moe_layers)}..: the trained predictor knows the decoder's "
                    f"{len(family.moe_layers)} MoE layers only. Load with mtp=False, or choose a policy without a "
                    "trained predictor file (ondemand, lru, lfu, static, mixtral-offloading; finemoe, auto without "
                    "files)") from e
            raise
        except BaseException:
            if source is not None and early is None:
                source.close()
            raise
        host = backend.host if isinstance(backend, OffloadedExperts) else None
        on_disk = host is not None and host.on_disk
        if on_disk and fp8 is not None:  # correct, but every read from disk requantizes an expert on the CPU
            log.warning("%s: experts stay on disk in FP8, so every read from disk requantizes one to int4 on the "
                        "CPU (about a second per expert at DeepSeek-V3 sizes): run `moeflow quantize %s DST` once "
                        "and load DST to read int4 experts as stored", config_path, directory)
        if mapped:
            source.close()
        elif direct is not None:  # started early, or through the CPU form cache here
            direct.finish(sorted(set(reader.weight_map.values())) if cpu_form_cache else None)
        elif early is not None:  # its store is the backend's: wait for the last expert
            early.result()
        elif not on_disk and fp8 is None:  # parallel preads straight into the backend's storage
            try:
                def convert() -> None:
                    load_experts(source, backend.load_expert, progress=progress)
                if cpu_form_cache and isinstance(backend, CpuInt4Experts):  # converted once, then mapped
                    cached_load(backend, sorted(set(reader.weight_map.values())), family.expert_spec().hidden_size,
                                family.expert_spec().intermediate_size, convert)
                else:
                    convert()
            finally:
                source.close()
        elif not on_disk:  # the disk tier reads its experts itself, when needed
            if source is not None:
                source.close()
            experts = loading.requantize_experts(loading.iter_experts(reader, family, layout, quant, progress,
                                                                     loading.mtp_moe_layers(mtp_module)), fmt)
            for moe_layer, expert, tensors in experts:
                backend.load_expert(moe_layer, expert, tensors)
        backend.finish_loading()
        if on_disk:
            host.finish_warm_fill()
            stats.disk = host.stats  # model.stats.summary() reports the disk traffic
        memory.fill_from_backend(plan, backend, offload, source.staging_nbytes if on_disk else 0)
    finally:
        if early is not None:  # (a failed build: the loader stops before its index's files close)
            early.cancel()
            early.index.close()
        if direct is not None:
            direct.close()
        reader.close()
    gen = GenerationConfig.from_file(directory / "generation_config.json", cfg.eos_token_id, cfg.pad_token_id)
    tokenizer_dir = gguf.tokenizer_directory() if gguf is not None else directory  # (GGUF: rebuilt, cached)
    tokenizer = None
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer(tokenizer_dir / "tokenizer.json")
    return BuiltModel(family, decoder, backend, stats, gen, tokenizer, resolved, device, dtype, plan, offload,
                      mtp_module)


def early_expert_load(offload: OffloadConfig | None, fmt: ExpertFormat, kernels: Kernels, family: Family,
                      reader: CheckpointReader, layout, quant, device: torch.device, progress: bool | None
                      ) -> ExpertLoad | None:
    """The experts' load, started before the decoder is built, where the backend's host store is known up front:
    an offloading policy on the CPU keeping every expert in a plain :class:`HostStore` (no ``host_memory_gb``,
    no ``background_load``). The store is created here in the backend's format and handed to it later
    (``make_expert_backend(host_store=)``); the experts are read and converted into it on loader threads while
    this thread loads and quantizes the non-expert weights. None elsewhere (the experts load after the backend)."""
    if offload is None or device.type != "cpu" or offload.host_memory_gb is not None or offload.background_load \
            or not get_policy(offload.policy).offload:
        return None
    layers = len(family.moe_layers)
    stored = expert_storage_format(fmt, kernels, offload)
    source = open_expert_index(reader, family, layout, quant, None, layers)
    store = real_host_store(stored, layers, family.num_experts, pin=offload.pin_memory, device=device)
    progress = show_progress(progress, fmt.nbytes * layers * family.num_experts)
    return ExpertLoad(source, store.write, store, progress=progress)


def default_offload(family: Family, fmt: ExpertFormat, device: torch.device, dtype: torch.dtype, non_expert: int,
                    what: str, cuda_graphs: bool = False, extra_moe_layers: int = 0,
                    ) -> tuple[OffloadConfig, tuple[memory.MemoryPlan, OffloadConfig] | None]:
    """The placement when the caller gave none: every expert on the device when they fit next to the non-expert
    weights, KV cache, activations, workspaces and graph pools in its free memory (always on the CPU); else
    ``OffloadConfig(policy="auto", gpu_memory_gb="auto")``, with a warning saying why and how to choose.
    Also the memory plan of the offloading choice (:func:`plan_memory`'s pair, its budget read from the device
    once), None for the resident one. ``extra_moe_layers``: MoE layers past the decoder's (the MTP layers')."""
    resident = OffloadConfig()
    if device.type != "cuda":
        return resident, None
    auto = OffloadConfig(policy="auto", gpu_memory_gb="auto")
    planned = plan_memory(auto, family, fmt, device, dtype, non_expert, cuda_graphs,  # refuses, naming every
                          extra_moe_layers)
    plan = planned[0]  # part, if even the offloading minimum does not fit
    room = plan.gpu_budget - memory.reserved_device_bytes(plan)
    need = (len(family.moe_layers) + extra_moe_layers) * family.num_experts * fmt.nbytes
    if room >= need:
        return resident, None
    log.warning("moeflow: %s: its experts (%s) do not fit in the %s of free device memory left after the rest of "
                "the model, KV cache and workspaces; offloading them (policy 'auto', slots from the free memory). "
                "Pass offload=OffloadConfig(...) to choose the policy and budget.", what, format_bytes(need),
                format_bytes(max(room, 0)))
    return auto, planned


def plan_memory(offload: OffloadConfig, family: Family, fmt: ExpertFormat, device: torch.device, dtype: torch.dtype,
                non_expert: int, cuda_graphs: bool = False, extra_moe_layers: int = 0,
                ) -> tuple[memory.MemoryPlan, OffloadConfig]:
    """The device side of the memory plan, and the config the backend sizes its slots with ("auto" resolved).
    ``cuda_graphs``: reserve the captured decode steps' pools (:func:`memory.graph_pool_bytes`);
    ``extra_moe_layers``: MoE layers past the decoder's (the MTP layers', whose experts share the slots)."""
    top_k = family.router_spec().top_k
    spec = family.kv_cache_spec()
    plan = memory.plan_device(
        offload, cfg=family.config, device=device, dtype=dtype, non_expert=non_expert, expert_bytes=fmt.nbytes,
        total_experts=(len(family.moe_layers) + extra_moe_layers) * family.num_experts, top_k=top_k,
        intermediate=family.expert_spec().intermediate_size, min_slots=min_slots(offload, top_k),
        offloads=get_policy(offload.policy).offload,
        kv_bytes_per_token=spec.bytes_per_token(dtype.itemsize),
        kv_bytes_per_sequence=spec.bytes_per_sequence(dtype.itemsize),
        graph_steps=memory.GRAPH_STEPS if cuda_graphs else 0)
    sized = offload
    if offload.gpu_memory_gb == "auto":
        sized = dataclasses.replace(offload, gpu_memory_gb=plan.gpu_budget / memory.GiB)
    return plan, sized


def open_expert_index(reader: CheckpointReader | Fp8BlockReader, family: Family, layout, quant,
                      requantize: ExpertFormat | None = None, num_layers: int | None = None) -> ExpertIndex:
    """The byte ranges of every expert in the checkpoint (the disk tier reads experts through it). ``requantize``:
    the AWQ format an FP8 checkpoint's dense experts become on every read, as at load."""
    # a converting reader (GPTQ, compressed-tensors, FP8) converts the raw tensors the index reads, as at load
    def read(r: CheckpointReader, layer: int, expert: int) -> dict[str, torch.Tensor]:
        tensors = family.read_expert(reader.over(r), layout, quant, layer, expert)
        if requantize is None:
            return tensors
        return awq_expert_tensors(tensors["w13"], tensors["w2"], requantize.group_size, requantize.dtype)

    return ExpertIndex(reader, read, num_layers or len(family.moe_layers), family.num_experts)


def _linear_factory(dtype: torch.dtype, awq_attention: dict | None):
    """Attention projections (and the families' dense MLPs): AWQ 4-bit when the checkpoint stores them so,
    else dense linears."""

    def make(name: str, fan_in: int, fan_out: int, bias: bool = False) -> nn.Module:
        if awq_attention is not None:
            return AWQLinear(fan_in, fan_out, awq_attention["group_size"], awq_attention["scales_dtype"], bias=bias)
        return nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype)

    return make
