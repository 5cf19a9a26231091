"""Generation settings (HF generation_config.json semantics) and token sampling."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from moeflow.compile_boundary import eager_host_step


@dataclass
class GenerationConfig:
    """Defaults for ``generate``; loaded from the checkpoint's generation_config.json, overridden per call."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0  # HF's: > 1 lowers the logits of every token already in the sequence
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_file(cls, path: Path, eos_token_id=None, pad_token_id=None) -> GenerationConfig:
        cfg = cls(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if not path.is_file():
            return cfg
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            return cfg
        # HF's max_length counts the prompt, which is unknown here: only max_new_tokens is taken
        known = {f.name for f in fields(cls)}
        return replace(cfg, **{k: v for k, v in data.items() if k in known and v is not None})

    def override(self, **kwargs) -> GenerationConfig:
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.do_sample:
            if self.min_p is not None and not 0 <= self.min_p <= 1:
                raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
            if self.temperature <= 0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature}")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
            if self.top_k is not None and self.top_k < 0:
                raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (``do_sample=False``: greedy). stop_token_ids end the sequence."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's log-probability and the k most likely
    min_p: float | None = None
    repetition_penalty: float = 1.0  # HF's, over the prompt and the reply
    presence_penalty: float = 0.0  # OpenAI's, over the reply: minus this once a token appeared
    frequency_penalty: float = 0.0  # OpenAI's, over the reply: minus this per time a token appeared
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, added to its logit)

    def generation_config(self) -> GenerationConfig:
        cfg = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample,
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                               repetition_penalty=self.repetition_penalty)
        cfg.validate()
        return cfg

    @property
    def adjusts_logits(self) -> bool:
        """Whether a token is chosen from changed logits (penalties, bias): greedy then goes through the sampler."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
                or bool(self.logit_bias))


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: logits fp32 [B, V], seen int64 [B, N] (every token of each row so far, repeats
    allowed) -> logits with each seen token's logit divided by ``penalty`` when positive, multiplied when not."""
    score = logits.gather(1, seen)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, seen, score)


def adjust_logits(logits: torch.Tensor, prompt_ids: list[int], generated: list[int],
                  logit_bias: tuple[tuple[int, float], ...], repetition_penalty: float, presence_penalty: float,
                  frequency_penalty: float) -> torch.Tensor:
    """One sequence's logits fp32 [1, V] before its sampler, in vLLM's order: OpenAI's ``logit_bias`` (token id,
    bias), HF's repetition penalty over the prompt and the reply, then OpenAI's presence and frequency
    penalties over the reply (minus ``presence`` once a token appeared, minus ``frequency`` per appearance)."""
    logits = logits.clone()
    for token, bias in logit_bias:
        logits[0, token] += bias
    if repetition_penalty != 1.0:
        seen = torch.tensor([prompt_ids + generated], dtype=torch.long)
        logits = penalize_repetitions(logits, seen, repetition_penalty)
    if generated and (presence_penalty or frequency_penalty):
        counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1])[None].float()
        logits -= frequency_penalty * counts + presence_penalty * (counts > 0).float()
    return logits


def warp_scores(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """Sampling's filters, HF's order: logits [B, V] -> fp32 scores [B, V] after temperature, top-k, top-p, min-p
    (the tokens filtered out at -inf)."""
    scores = logits.float() / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if cfg.min_p:  # tokens less likely than min_p x the most likely one (which always stays)
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < cfg.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None,
                seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: the repetition penalty over ``seen`` int64 [B, N] (when the config has
    one), then argmax, or a draw from :func:`warp_scores`."""
    if cfg.repetition_penalty != 1.0 and seen is not None and seen.numel():
        logits = penalize_repetitions(logits.float(), seen, cfg.repetition_penalty)
    if not cfg.do_sample:
        if logits.dtype == torch.float32 and eager_host_step(logits):
            # numpy's argmax (the first largest, NaN the largest, as torch's) takes ~4 us for a 32000-entry row
            # where torch's CPU reduction takes ~45
            return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
        return logits.argmax(dim=-1)
    probs = warp_scores(logits, cfg).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
