"""Generation settings (HF generation_config.json semantics) and token sampling."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch


@dataclass
class GenerationConfig:
    """Defaults for ``generate``; loaded from the checkpoint's generation_config.json, overridden per call."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
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
        if self.do_sample:
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


def next_tokens(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax, or temperature -> top-k -> top-p sampling (HF's order)."""
    if not cfg.do_sample:
        return logits.argmax(dim=-1)
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
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
