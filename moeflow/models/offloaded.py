"""``MoEOffloadedMixtral``: the public model class (loading, forward, generate, stats)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.errors import InputError
from moeflow.models import loading
from moeflow.models.checkpoint import CheckpointReader, read_json, read_quantization, resolve_checkpoint
from moeflow.models.generation import GenerationConfig, next_tokens
from moeflow.models.kv_cache import StaticKVCache
from moeflow.models.mixtral import MixtralConfig, MixtralModel
from moeflow.models.tokenizer import Tokenizer
from moeflow.moe.backend import StepInfo
from moeflow.offload.stats import Stats

KERNEL_CHOICES = ("auto", "torch", "triton", "cpu-int4")
PROGRESS_MIN_BYTES = 256 * 2**20  # show a loading progress bar above this much expert data
KV_BUDGET_TOKENS = 4096  # context assumed when sizing expert slots from gpu_memory_gb


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # fp32 [B, T, vocab]


def resolve_kernels(kernels: str, device: torch.device, awq: bool) -> str:
    """auto: Triton on CUDA; on the CPU torch's int4 kernels for AWQ experts, else the torch reference."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}: expected one of {KERNEL_CHOICES}")
    if kernels == "auto":
        if device.type == "cuda":
            return "triton"
        from moeflow.kernels.cpu_int4 import int4_cpu_available

        return "cpu-int4" if awq and int4_cpu_available() else "torch"
    if kernels == "cpu-int4":
        from moeflow.kernels.cpu_int4 import int4_cpu_available

        if device.type != "cpu" or not awq:
            raise ValueError("kernels='cpu-int4' computes AWQ experts on the CPU: it needs device='cpu' and an AWQ "
                             "checkpoint")
        if not int4_cpu_available():
            raise ValueError("kernels='cpu-int4': this torch build lacks the int4 CPU kernels "
                             "(_weight_int4pack_mm_for_cpu); use kernels='torch'")
    if kernels == "triton" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on the CPU means its interpreter
    return kernels


class MoEOffloadedMixtral(nn.Module):
    """A Mixtral whose experts are kept resident or streamed by moeflow's scheduler.

    Build it with :meth:`from_pretrained`. ``model(input_ids)`` returns ``.logits`` ``[B, T, vocab]``;
    :meth:`generate` returns token ids including the prompt, as transformers does.
    """

    def __init__(
        self, config: MixtralConfig, model: MixtralModel, device: torch.device, dtype: torch.dtype,
        offload: OffloadConfig, stats: Stats, generation_config: GenerationConfig,
        tokenizer: Tokenizer | None = None, kernels: str = "torch", name: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.device, self.dtype = device, dtype
        self.offload = offload
        self.stats = stats
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.kernels = kernels
        self.name_or_path = name
        self._decode_step = self._step
        self._compiled = False

    # ------------------------------------------------------------------ loading
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
    ) -> MoEOffloadedMixtral:
        """Load an HF-layout Mixtral checkpoint (fp32/fp16/bf16 or AWQ 4-bit) from a directory or the hub.

        dtype: activation/weight dtype; default float16 on CUDA and float32 on the CPU.
        offload: where experts live (default: all resident).
        kernels: "auto" (Triton on CUDA; on the CPU torch's int4 kernels for AWQ experts, else the torch
            reference), "torch" (the reference), "triton", or "cpu-int4".
        compile: torch.compile the decode step.
        """
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but torch sees no CUDA device")
        dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype={dtype}: expected torch.float16, torch.bfloat16 or torch.float32")
        offload = offload or OffloadConfig()

        directory = resolve_checkpoint(path_or_id, revision)
        raw_config = read_json(directory / "config.json")
        model_type = raw_config.get("model_type")
        if model_type not in (None, "mixtral"):
            raise ValueError(f"{directory / 'config.json'}: model_type {model_type!r} is not a Mixtral")
        cfg = MixtralConfig.from_dict(raw_config, str(directory / "config.json"))
        quant = read_quantization(directory, raw_config)
        reader = CheckpointReader(directory)
        source = loading.detect_expert_source(reader, cfg)
        fmt = loading.expert_format(cfg, source, quant, dtype)
        awq_attention = loading.detect_awq_attention(reader, quant)
        kernels_backend = resolve_kernels(kernels, device, fmt.kind == "awq")

        model = MixtralModel(cfg, dtype, awq_attention)
        loading.load_non_expert_weights(model, reader, cfg, source, device, dtype)
        linear_backend = "torch" if kernels_backend == "cpu-int4" else kernels_backend
        for module in model.modules():
            if hasattr(module, "kernels_backend"):
                module.kernels_backend = linear_backend
        model.rotary.to(device)

        stats = Stats()
        kv_bytes = 2 * cfg.num_hidden_layers * min(cfg.max_position_embeddings, KV_BUDGET_TOKENS) \
            * cfg.num_key_value_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
        backend = _create_expert_backend(
            offload, fmt=fmt, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok, device=device, kernels_backend=kernels_backend,
            gates=[layer.block_sparse_moe.gate for layer in model.layers],
            reserved_bytes=loading.non_expert_bytes(model) + kv_bytes, stats=stats,
            checkpoint_dir=directory,
        )
        if progress is None:
            progress = fmt.nbytes * cfg.num_hidden_layers * cfg.num_local_experts >= PROGRESS_MIN_BYTES
        for layer, expert, tensors in loading.iter_experts(reader, cfg, source, quant, progress):
            backend.load_expert(layer, expert, tensors)
        backend.finish_loading()
        for layer in model.layers:
            layer.block_sparse_moe.experts = backend
        reader.close()

        gen = GenerationConfig.from_file(
            directory / "generation_config.json", cfg.eos_token_id, cfg.pad_token_id
        )
        tokenizer = Tokenizer(directory / "tokenizer.json") if (directory / "tokenizer.json").is_file() else None
        self = cls(cfg, model, device, dtype, offload, stats, gen, tokenizer, kernels_backend, str(path_or_id))
        self.eval()
        if compile:
            self.compile_decode()
        return self

    @property
    def experts(self):
        """The expert backend shared by every MoE layer."""
        return self.model.layers[0].block_sparse_moe.experts

    def compile_decode(self) -> None:
        """torch.compile the one-token decode step (fullgraph when every expert is resident)."""
        from moeflow.moe import ResidentExperts

        fullgraph = isinstance(self.experts, ResidentExperts)
        self._decode_step = torch.compile(self._step, fullgraph=fullgraph, dynamic=False)
        self._compiled = True

    # ------------------------------------------------------------------ forward
    def _check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError(f"input_ids must be a [batch, seq] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise InputError("input_ids is empty: the prompt needs at least one token")
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise InputError(
                    f"input_ids holds token id {bad}, outside the vocabulary [0, {self.config.vocab_size})"
                )
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise InputError(
                f"input_ids has {input_ids.shape[1]} tokens, longer than max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InputError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
            )

    def _new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        return StaticKVCache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim,
                             self.dtype, self.device)

    def _step(self, input_ids, position_ids, cache, cache_position, token_mask):
        return self.model(input_ids, position_ids, cache, cache_position, token_mask)

    @staticmethod
    def _positions(token_mask: torch.Tensor) -> torch.Tensor:
        """Position ids from a left-padded mask [B, T]: count of real tokens so far minus one (0 on padding)."""
        pos = token_mask.long().cumsum(-1) - 1
        return pos.clamp(min=0)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids [B, T] (attention_mask [B, T], 1 = real token) -> CausalLMOutput(logits fp32 [B, T, vocab])."""
        self._check_inputs(input_ids, attention_mask)
        input_ids = input_ids.to(self.device, torch.long)
        b, t = input_ids.shape
        token_mask = (attention_mask.to(self.device) != 0) if attention_mask is not None else \
            torch.ones((b, t), dtype=torch.bool, device=self.device)
        cache = self._new_cache(b, t)
        self.stats.set_phase("prefill")
        logits = self._step(input_ids, self._positions(token_mask), cache,
                            torch.arange(t, device=self.device), token_mask)
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
    ) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` tokens; returns ``[B, T + n]`` ids including the prompt.

        Defaults come from the checkpoint's generation_config.json; arguments given here override them.
        Prompts of a batch are left-padded, with ``attention_mask`` marking the real tokens. A sequence
        that produced an EOS is continued with ``pad_token_id`` until every sequence is done.
        ``streamer``: an object with ``put(ids)`` and ``end()`` (transformers' streamers work).
        ``micro_batch_size``: run the batch as micro-batches of at most this many sequences, regrouped
        before every step by routing-path similarity (ExpertFlow's token scheduler): the first step by
        ``path_predictor.predict_paths(input_ids, attention_mask, last_only=...) -> bool [B, L, E]`` when
        given (the prefill by the prompt's paths, each decode step by its own token's predicted path, which
        is known before the step runs), else contiguous groups first and then the paths each sequence's
        last token took.
        """
        gen = self.generation_config.override(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )
        gen.validate()
        self._check_inputs(input_ids, attention_mask)
        if attention_mask is not None:
            _check_left_padded(attention_mask)
        b, t = input_ids.shape
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or not 1 <= micro_batch_size <= b):
            raise ValueError(f"micro_batch_size must be an integer in [1, batch={b}], got {micro_batch_size!r}")
        total = t + gen.max_new_tokens
        if total > self.config.max_position_embeddings:
            raise InputError(
                f"prompt ({t} tokens) + max_new_tokens ({gen.max_new_tokens}) exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        device = self.device
        input_ids = input_ids.to(device, torch.long)
        token_mask = (attention_mask.to(device) != 0) if attention_mask is not None else \
            torch.ones((b, t), dtype=torch.bool, device=device)
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        eos = torch.tensor(gen.eos_ids(), dtype=torch.long, device=device)
        pad = gen.pad_token_id if gen.pad_token_id is not None else (gen.eos_ids() or [0])[0]

        if streamer is not None:
            streamer.put(input_ids.cpu())
        cache = self._new_cache(b, total)
        out = [input_ids]
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        positions = self._positions(token_mask)
        self.stats.ttft_s = self.stats.tpot_s = None
        start = time.perf_counter()
        decode_times: list[float] = []
        if gen.max_new_tokens == 0:
            return input_ids

        scheduler = _MicroBatcher(self, b, micro_batch_size)
        if micro_batch_size is not None:
            scheduler.regroup_predicted(path_predictor, input_ids, token_mask, "prefill", False)
        self.stats.set_phase("prefill")
        try:
            logits = scheduler.run(self._step, input_ids, positions, cache, torch.arange(t, device=device),
                                   token_mask)
            next_pos = positions[:, -1] + 1
            for step in range(gen.max_new_tokens):
                tok = next_tokens(logits, gen, generator)
                tok = torch.where(finished, torch.full_like(tok, pad), tok)
                out.append(tok[:, None])
                if eos.numel():
                    finished |= torch.isin(tok, eos)
                self._sync()
                now = time.perf_counter()
                phase = self.stats.current()
                phase.steps += 1
                phase.tokens += b * (t if step == 0 else 1)
                phase.time_s += now - start
                if step == 0:
                    self.stats.ttft_s = now - start
                else:
                    decode_times.append(now - start)
                if streamer is not None:
                    streamer.put(tok.cpu())
                if step + 1 == gen.max_new_tokens or bool(finished.all()):
                    break
                start = time.perf_counter()
                self.stats.set_phase("decode")
                if micro_batch_size is not None:
                    history = torch.cat(out, dim=1)
                    history_mask = torch.cat([token_mask, torch.ones_like(history[:, t:], dtype=torch.bool)], 1)
                    scheduler.regroup_predicted(path_predictor, history, history_mask, "decode", True)
                cache_position = torch.tensor([t + step], device=device)
                logits = scheduler.run(self._decode_step, tok[:, None], next_pos[:, None], cache, cache_position,
                                       torch.ones((b, 1), dtype=torch.bool, device=device))
                next_pos = next_pos + 1
        finally:
            scheduler.close()
        if decode_times:
            self.stats.tpot_s = sum(decode_times) / len(decode_times)
        self._record_peak_memory()
        if streamer is not None:
            streamer.end()
        return torch.cat(out, dim=1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record_peak_memory(self) -> None:
        if self.device.type == "cuda":
            self.stats.peak_gpu_bytes = max(self.stats.peak_gpu_bytes, torch.cuda.max_memory_allocated(self.device))

    def __repr__(self) -> str:
        c = self.config
        return (f"MoEOffloadedMixtral({self.name_or_path!r}, layers={c.num_hidden_layers}, "
                f"experts={c.num_local_experts}, top_k={c.num_experts_per_tok}, device={self.device}, "
                f"dtype={self.dtype}, policy={self.offload.policy!r}, kernels={self.kernels!r})")


class _MicroBatcher:
    """Runs a step for the whole batch, or micro-batch by micro-batch regrouped by routing paths (ExpertFlow)."""

    def __init__(self, model: MoEOffloadedMixtral, batch: int, micro_batch_size: int | None):
        from moeflow.offload.rebatch import group_by_routing

        self.model, self.batch, self.size = model, batch, micro_batch_size
        self._group = group_by_routing
        cfg = model.config
        self.blocks = [layer.block_sparse_moe for layer in model.model.layers]
        self.paths = torch.zeros((batch, cfg.num_hidden_layers, cfg.num_local_experts), dtype=torch.bool)
        self.groups = [list(range(batch))]
        if micro_batch_size is not None:
            self.groups = [list(range(i, min(i + micro_batch_size, batch))) for i in range(0, batch, micro_batch_size)]
            for block in self.blocks:
                block.record_routing = True

    def regroup(self, paths: torch.Tensor) -> None:
        """paths bool [B, L, E] (predicted or observed) -> new micro-batches."""
        self.groups = self._group(paths.cpu(), self.size)

    def regroup_predicted(self, path_predictor, ids: torch.Tensor, mask: torch.Tensor, phase: str,
                          last_only: bool) -> None:
        """Regroup by predicted paths of the next step: the caller's ``path_predictor`` (ids/mask API), else the
        backend's (``predict_paths(StepInfo)``); neither: keep the groups."""
        if path_predictor is not None:
            paths = path_predictor.predict_paths(ids, mask, last_only=last_only)
        else:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            step = StepInfo(ids, positions, mask, phase, history_ids=ids, history_mask=mask)
            paths = self.model.experts.predict_paths(step, last_only)
        if paths is not None:
            self.regroup(paths)

    def run(self, step_fn, ids, positions, cache, cache_position, token_mask) -> torch.Tensor:
        """Logits of the last position [B, V] for inputs [B, T]."""
        if self.size is None:
            return step_fn(ids, positions, cache, cache_position, token_mask)[:, -1]
        logits = None
        for group in self.groups:
            rows = torch.tensor(group, dtype=torch.long, device=ids.device)
            out = step_fn(ids[rows], positions[rows], cache.rows(rows), cache_position, token_mask[rows])[:, -1]
            if logits is None:
                logits = out.new_empty((self.batch, out.shape[-1]))
            logits[rows] = out
            for layer, block in enumerate(self.blocks):
                last = block.last_topk_ids[:, -1].long().cpu()  # [b, k] experts of each sequence's last token
                self.paths[group, layer] = False
                self.paths[torch.tensor(group)[:, None], layer, last] = True
        self.regroup(self.paths)
        return logits

    def close(self) -> None:
        for block in self.blocks:
            block.record_routing = False
            block.last_topk_ids = None


def _check_left_padded(attention_mask: torch.Tensor) -> None:
    """generate() takes left-padded batches: 0/1 masks, every row's real tokens at its end, at least one each."""
    m = attention_mask.detach().cpu()
    if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
        raise InputError("attention_mask must hold 0 (padding) or 1 (real token)")
    m = m != 0
    empty = (~m.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask marks no real token in row(s) {empty[:8]}: every prompt needs at least one")
    right = (m[:, :-1] & ~m[:, 1:]).any(dim=1).nonzero().flatten().tolist()
    if right:
        raise InputError(f"attention_mask row(s) {right[:8]} have padding after a real token: generate() expects "
                         "left padding (padding first, the prompt's tokens at the end of the row)")


def _create_expert_backend(config: OffloadConfig, **kw):
    """CPU int4 experts for the resident CPU case; otherwise the scheduler's backend for the policy."""
    from moeflow.offload import create_expert_backend

    if kw["kernels_backend"] == "cpu-int4":
        if config.policy == "resident":
            from moeflow.moe import CpuInt4Experts

            return CpuInt4Experts(kw["fmt"], kw["num_layers"], kw["num_experts"])
        kw = {**kw, "kernels_backend": "torch"}  # the slot pool holds AWQ bytes: the scheduler computes with torch
    return create_expert_backend(config, **kw)
