"""One sequence's next token from its logits, by its own sampling settings, generator and grammar (the serving
engine's, :mod:`moeflow.engine.continuous`)."""

from __future__ import annotations

import torch

from moeflow.engine.sampling import adjust_logits, next_tokens
from moeflow.engine.sequence import Sequence


def sample_token(seq: Sequence, logits: torch.Tensor) -> int:
    """logits fp32 [V] -> the next token, by the sequence's own settings and generator."""
    params, logits = seq.params, logits[None].float()
    if params.adjusts_logits:
        logits = adjust_logits(logits, seq.prompt_ids, seq.generated, params.logit_bias,
                               params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    allowed = seq.guide.allowed() if seq.guide is not None else None
    if allowed is not None:
        logits = logits.masked_fill(~allowed[None], float("-inf"))
    token = int(next_tokens(logits, seq.sampler_config, seq.generator)[0])
    if seq.guide is not None:
        seq.guide.advance(token)
    return token
