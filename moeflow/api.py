"""The public model classes: :class:`MoEModel` (any supported family) and :class:`MoEOffloadedMixtral`."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.engine.build import KERNEL_CHOICES, build_model
from moeflow.engine.compiled import CompiledDecode
from moeflow.engine.cuda_graphs import CudaGraphDecode, graphs_wanted
from moeflow.engine.generate import (
    Runner,
    check_inputs,
    check_left_padded,
    deprecated_path_predictor,
    generate,
    positions_from_mask,
)
from moeflow.engine.lookup import DEFAULT_MAX_NGRAM, check_lookup, generate_with_lookup
from moeflow.engine.mtp import check_mtp, generate_with_mtp
from moeflow.engine.mtp_prefetch import check_proxy
from moeflow.engine.sampling import GenerationConfig
from moeflow.errors import InputError
from moeflow.families import Family, MixtralFamily
from moeflow.kernels.cpu import hugepages
from moeflow.moe.backend import ExpertBackend

__all__ = ["MoEModel", "MoEOffloadedMixtral", "CausalLMOutput", "KERNEL_CHOICES"]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # fp32 [B, T, vocab]


class MoEModel(nn.Module):
    """A Mixture-of-Experts LM whose experts are kept resident or streamed by moeflow's scheduler.

    Build it with :meth:`from_pretrained`, which picks the family from config.json's ``model_type``.
    ``model(input_ids)`` returns ``.logits`` ``[B, T, vocab]``; :meth:`generate` returns token ids
    including the prompt, as transformers does.
    """

    _families: tuple[type[Family], ...] | None = None  # restrict from_pretrained to these (None: any)

    def __init__(self, family: Family, model: nn.Module, backend: ExpertBackend, runner: Runner,
                 offload: OffloadConfig, generation_config: GenerationConfig, tokenizer=None, kernels: str = "torch",
                 name: str = "") -> None:
        super().__init__()
        self.family = family
        self.config = family.config
        self.model = model  # the decoder (embeddings, layers, LM head); experts live in ``experts``
        self.backend = backend
        self._runner = runner
        self.device, self.dtype = runner.device, runner.dtype
        self.offload = offload
        self.stats = runner.stats
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.kernels = kernels
        self.name_or_path = name
        self._compiled = False
        self.mtp = None  # the multi-token-prediction layers (from_pretrained(mtp=True))
        # close the backend once: on close(), or when the model is garbage-collected
        self._closer = weakref.finalize(self, runner.close_backend)

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        offload: OffloadConfig | None = None,
        kernels: str = "auto",
        compile: bool = False,
        revision: str | None = None,
        progress: bool | None = None,
        attention_bits: int | str | None = "auto",
        cuda_graphs: bool | None = None,
        lm_head_bits: int = 8,
        mtp: bool = False,
        background_load: bool = False,
        gguf_file: str | None = None,
        mmap: bool = True,
        cpu_form_cache: bool = False,
    ):
        """Load an HF-layout checkpoint (fp32/fp16/bf16 or AWQ 4-bit) from a directory or the hub, or a GGUF model
        (llama.cpp's files: a ``.gguf`` path, a directory holding one, the first part of a split set, or a
        directory / hub id with ``gguf_file``; :mod:`moeflow.io.gguf`).

        dtype: activation/weight dtype; default float16 on CUDA and float32 on the CPU.
        offload: where experts live. None (default): every expert on the device when they all fit next to the
            rest (on the CPU, always), else offloaded with ``OffloadConfig(policy="auto", gpu_memory_gb="auto")``
            (the slots sized from the device's free memory), said in a logged warning; ``model.offload`` holds
            the choice.
        kernels: "auto" (Triton on CUDA; on the CPU torch's int4 kernels for AWQ experts, else the torch
            reference), "torch" (the reference), "triton", or "cpu-int4".
        compile: torch.compile the decode step.
        cuda_graphs: capture the decode step as CUDA graphs, piecewise around an offloading backend's calls
            (see :mod:`moeflow.engine.cuda_graphs`); eager with a logged warning when the device refuses the
            capture. None (default): on when ``device`` is CUDA, off otherwise; True off CUDA: ValueError.
            With graphs the KV cache is kept between generate() calls, its length rounded up to a multiple
            of 256 positions, so calls within one such bucket replay the same graphs.
        attention_bits: on the CPU int4 path (device="cpu", AWQ experts), quantize 16-bit attention
            projections at load to int8 (8) or int4 (4, group 128); None keeps them as stored; "auto"
            (default): int8 on that path (held-out bits/byte of the embedded model +0.01%, docs/cpu.md),
            kept as stored elsewhere. That path always runs AWQ attention through the int4
            CPU kernel.
        lm_head_bits: on the CPU int4 path, the lm_head in int8 (8, default) or int4 (4: ~half the bytes per
            decoded token; the top 16 logits, so the greedy tokens, recomputed in int8, the others with int4's
            error; see :mod:`moeflow.kernels.cpu.lm_head`).
        mtp: also read the checkpoint's multi-token-prediction layers (DeepSeek-V3 / GLM-4.5's
            ``num_nextn_predict_layers``, Qwen3-Next / Qwen3.5-MoE's ``mtp_num_hidden_layers``) for
            ``generate(num_speculative_tokens=k)``; their experts join the
            expert backend (offloaded like the others) as its last MoE layers. CheckpointError when the
            checkpoint has none.
        background_load: return once the non-expert weights are loaded, the experts filling host memory in the
            background (``OffloadConfig.background_load``; an offloading ``offload`` is required).
        gguf_file: the GGUF file to load from the directory or hub repository ``path_or_id`` (as transformers'
            ``gguf_file=``).
        mmap: a GGUF model's experts that the CPU computes as the file stores them (Q8_0, Q4_K, Q5_K, Q6_K,
            Q4_0 beside another type: Q4_K_M's and Q8_0's files), all resident on ``device="cpu"``, are views of a
            copy-on-write mapping of the file, as llama.cpp's default load: nothing is read or copied at load, pages
            come in from the page cache when first used (:mod:`moeflow.engine.mapped_experts`); on
            ``device="cpu"`` the embedding's rows are dequantized from the mapped file when looked up
            (:mod:`moeflow.engine.stored_embedding`). False copies them at load. Other cases always copy (CUDA,
            offloading policies, experts all Q4_0: converted).
        cpu_form_cache: resident experts on ``device="cpu"`` in moeflow's CPU int4 form (AWQ checkpoints, GGUF Q4_0
            files) are converted on the first load and written to ``moeflow.user_cache.cache_dir() / "cpu_forms"``
            (keyed by the checkpoint files' names, sizes and times, and the kernels' revision), later loads map
            that file instead of converting (:mod:`moeflow.engine.cpu_form_cache`). No effect elsewhere.
        """
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but torch sees no CUDA device")
        dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype={dtype}: expected torch.float16, torch.bfloat16 or torch.float32")
        cuda_graphs = graphs_wanted(cuda_graphs, device)  # (before loading: True on a CPU model is refused at once)
        if background_load:
            if offload is None:
                raise ValueError("from_pretrained(background_load=True) needs an offloading OffloadConfig (e.g. "
                                 "OffloadConfig(policy='lru', gpu_expert_slots=...)): the experts fill host memory "
                                 "in the background and reach the slots from there")
            offload = dataclasses.replace(offload, background_load=True)
        with hugepages.deferred():  # the CPU forms written on small pages, collapsed onto huge ones once ready
            built = build_model(path_or_id, device=device, dtype=dtype, offload=offload, kernels=kernels,
                                revision=revision, progress=progress, families=cls._families,
                                attention_bits=attention_bits, lm_head_bits=lm_head_bits, cuda_graphs=cuda_graphs,
                                mtp=mtp, gguf_file=gguf_file, mmap=mmap, cpu_form_cache=cpu_form_cache)
        runner = Runner(built.decoder, built.backend, built.stats, built.family.config, device, dtype,
                        kv_cache_spec=built.family.kv_cache_spec)
        self = cls(built.family, built.decoder, built.backend, runner, built.offload, built.generation_config,
                   built.tokenizer, built.kernels.choice, str(path_or_id))
        self._memory_plan = built.memory_plan
        self.mtp = built.mtp  # the multi-token-prediction layers (from_pretrained(mtp=True)), or None
        self.eval()
        if compile:
            self.compile_decode()
        if cuda_graphs:
            self.capture_decode()
        return self

    @property
    def runner(self) -> Runner:
        """Runs forward passes of this model (the continuous-batching engine drives it with its own cache)."""
        return self._runner

    @property
    def experts(self) -> ExpertBackend:
        """The expert backend shared by every MoE layer."""
        return self.backend

    def memory_plan(self):
        """How device and host memory are split (:class:`moeflow.engine.memory.MemoryPlan`: ``summary()``,
        ``as_dict()``): non-expert weights, KV cache, activations, workspaces, expert slots, host expert cache."""
        return self._memory_plan

    def use_backend(self, backend: ExpertBackend | None) -> ExpertBackend | None:
        """Swap the expert backend (benchmarks compare policies on one loaded model); returns the previous one.
        The new backend must already hold every expert (``finish_loading`` called). None detaches it."""
        previous, self.backend = self.backend, backend
        self._runner.backend = backend
        return previous

    def compile_decode(self, backend: str | Callable = "inductor") -> None:
        """torch.compile the one-token decode step (``backend``: the dynamo backend). One graph when every
        expert is resident; with an offloading backend, one graph break per MoE layer (its compiler-disabled
        ``forward``) and the decoder layers share their graphs: see :mod:`moeflow.engine.compiled`."""
        compiled = CompiledDecode(self.model, backend)
        if isinstance(self._runner.decode_fn, CudaGraphDecode):  # captured: capture the compiled step instead
            old = self._runner.decode_fn
            self._runner.decode_fn = CudaGraphDecode(compiled, old.capture_factory, old.capture_experts)
        else:
            self._runner.decode_fn = compiled
        self._compiled = True

    def capture_decode(self, capture_factory=None, capture_experts: bool = True) -> CudaGraphDecode:
        """Replay the decode step (eager or compiled) as CUDA graphs, piecewise around the expert backend's calls
        (:class:`moeflow.engine.cuda_graphs.CudaGraphDecode`, returned; ``capture_factory``: how a piece is
        captured, default CUDA graphs, which need device="cuda"; ``capture_experts=False`` leaves an offload
        backend's device part eager, for A/B runs). The KV cache is kept from one generate to the next of the
        same batch size and length bucket (:func:`moeflow.engine.generate.cache_length`) so the graphs are not
        captured again."""
        if capture_factory is None:
            graphs_wanted(True, self.device)  # ValueError off CUDA
        decode = self._runner.decode_fn
        inner = decode.inner if isinstance(decode, CudaGraphDecode) else decode
        self._runner.decode_fn = CudaGraphDecode(inner, capture_factory, capture_experts)
        self._runner.reuse_cache = True
        return self._runner.decode_fn

    def close(self) -> None:
        """Release the expert backend's threads, streams and host registrations (once; also on deletion)."""
        self._closer()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids [B, T] (attention_mask [B, T], 1 = real token) -> CausalLMOutput(logits fp32 [B, T, vocab])."""
        check_inputs(input_ids, attention_mask, self.config.vocab_size, self.config.max_position_embeddings)
        input_ids = input_ids.to(self.device, torch.long)
        b, t = input_ids.shape
        token_mask = (attention_mask.to(self.device) != 0) if attention_mask is not None else \
            torch.ones((b, t), dtype=torch.bool, device=self.device)
        self.stats.set_phase("prefill")
        logits = self._runner.forward_pass(input_ids, positions_from_mask(token_mask),
                                           self._runner.new_cache(b, t, reuse=False),
                                           torch.arange(t, device=self.device), token_mask, "prefill",
                                           history=(input_ids, token_mask))
        return CausalLMOutput(logits=logits)

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        streamer=None,
        seed: int | None = None,
        micro_batch_size: int | None = None,
        path_predictor=None,
        dual_batch: bool | None = None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int | None = None,
        num_speculative_tokens: int | None = None,
        mtp_prefetch: str | None = None,
    ) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` tokens; returns ``[B, T + n]`` ids including the prompt.

        Defaults come from the checkpoint's generation_config.json; arguments given here override them.
        Prompts of a batch are left-padded, with ``attention_mask`` marking the real tokens. A sequence
        that produced an EOS is continued with ``pad_token_id`` until every sequence is done.
        ``streamer``: an object with ``put(ids)`` and ``end()`` (transformers' streamers work).
        ``repetition_penalty`` and ``min_p`` as transformers (5.x) applies them (the penalty over the row's
        tokens so far, its left padding excepted, greedy or sampled; min-p after top-p).
        ``micro_batch_size``: run the batch as micro-batches of at most this many sequences, regrouped
        before every step by routing-path similarity (ExpertFlow's token scheduler): by the paths the
        expert backend predicts (``experts.predict_paths``: the expertflow policy predicts them from the
        token ids; the prefill by the prompt's paths, each decode step by its own token's path, known
        before the step runs), else contiguous groups first and then the paths each sequence's last token
        took. ``path_predictor`` (deprecated): an object with ``predict_paths(ids, mask, last_only=...)``
        used instead of the backend's. ``dual_batch``: decode through the policy's decode strategy
        (``PolicySpec.decode``: expertflow's dual-batch pipeline, path prediction and token scheduling of the next
        micro-batch beside the current one's pass; docs/expertflow.md); default (None): on with micro-batches
        under a policy that declares one; True with another policy raises SchedulingError. Its counters:
        ``pipeline_stats``.
        ``prompt_lookup_num_tokens`` (transformers' name): greedy decoding that drafts up to this many tokens per
        pass by matching the last ``max_matching_ngram_size`` (default 2) tokens earlier in the sequence and
        verifies the draft in one pass (``moeflow.engine.lookup``: the same tokens as plain greedy decoding; one
        sequence; counters ``stats.draft_tokens`` / ``stats.accepted_tokens``).
        ``num_speculative_tokens`` (vLLM's name): decoding that drafts up to this many tokens per pass with the
        model's own multi-token-prediction layers (load with ``mtp=True``) and verifies them in one pass
        (``moeflow.engine.mtp``: greedy, the tokens of plain greedy decoding; sampled, standard speculative
        sampling, distributed as plain sampling; one sequence; ``stats.draft_tokens``,
        ``stats.accepted_tokens``, ``stats.generated_tokens``, ``stats.bytes_per_generated_token``).
        ``mtp_prefetch``: with ``num_speculative_tokens``, predict each verify pass's experts from its drafts and
        queue their copies before it (``moeflow.engine.mtp_prefetch``: "mtp", "mtp-only", "embed"; default None:
        off, since on the trained model it moves more bytes than it saves, benchmarks/results/mtp/README.md;
        counters ``stats.draft_prefetch``).
        """
        gen = self.generation_config.override(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, repetition_penalty=repetition_penalty,
            min_p=min_p,
        )
        gen.validate()
        check_inputs(input_ids, attention_mask, self.config.vocab_size, self.config.max_position_embeddings)
        if attention_mask is not None:
            check_left_padded(attention_mask)
        b, t = input_ids.shape
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or not 1 <= micro_batch_size <= b):
            raise ValueError(f"micro_batch_size must be an integer in [1, batch={b}], got {micro_batch_size!r}")
        if t + gen.max_new_tokens > self.config.max_position_embeddings:
            raise InputError(
                f"prompt ({t} tokens) + max_new_tokens ({gen.max_new_tokens}) exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        input_ids = input_ids.to(self.device, torch.long)
        token_mask = (attention_mask.to(self.device) != 0) if attention_mask is not None else \
            torch.ones((b, t), dtype=torch.bool, device=self.device)
        if num_speculative_tokens is not None:
            check_mtp(self.family, self.mtp, gen, b, num_speculative_tokens, micro_batch_size, dual_batch,
                      prompt_lookup_num_tokens)
            check_proxy(mtp_prefetch)
            return generate_with_mtp(self._runner, self.mtp, gen, input_ids, token_mask, num_speculative_tokens,
                                     streamer=streamer, seed=seed, prefetch=mtp_prefetch)
        if prompt_lookup_num_tokens is not None or max_matching_ngram_size is not None:
            ngram = max_matching_ngram_size if max_matching_ngram_size is not None else DEFAULT_MAX_NGRAM
            check_lookup(gen, b, prompt_lookup_num_tokens, ngram, micro_batch_size, dual_batch)
            return generate_with_lookup(self._runner, gen, input_ids, token_mask, prompt_lookup_num_tokens, ngram,
                                        streamer=streamer)
        predict = deprecated_path_predictor(path_predictor) if path_predictor is not None else None
        return generate(self._runner, gen, input_ids, token_mask, streamer=streamer, seed=seed,
                        micro_batch_size=micro_batch_size, predict_paths=predict, dual_batch=dual_batch)

    @property
    def pipeline_stats(self):
        """The dual-batch pipeline's counters of the last ``generate`` that ran it (PipelineStats), else None."""
        return self._runner.pipeline_stats

    def __repr__(self) -> str:
        c, f = self.config, self.family
        return (f"{type(self).__name__}({self.name_or_path!r}, layers={c.num_hidden_layers}, "
                f"experts={f.num_experts}, top_k={f.router_spec().top_k}, device={self.device}, "
                f"dtype={self.dtype}, policy={self.offload.policy!r}, kernels={self.kernels!r})")


class MoEOffloadedMixtral(MoEModel):
    """A Mixtral whose experts are kept resident or streamed by moeflow's scheduler (see :class:`MoEModel`);
    ``from_pretrained`` accepts Mixtral checkpoints only."""

    _families = (MixtralFamily,)
