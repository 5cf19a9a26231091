"""Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for MTP drafts: a draft token x drawn from
the draft distribution q is kept with probability min(1, p(x) / q(x)), p being the target model's distribution at
its position; at the first rejection the token is drawn from the residual max(0, p - q) (normalised) and the round
ends; when every draft token is kept a bonus token is drawn from p after the last. Each output token is then
distributed as p, whatever q is, so sampling with speculation samples the target model.

p and q are the same sampler's distributions (:func:`sampler_probs`: the repetition penalty over the tokens so far,
then temperature, top-k, top-p, min-p as :func:`moeflow.engine.sampling.warp_scores`), of the main model's and the
MTP layer's logits. With a sampler that keeps one token (``top_k=1``) p and q are one-hot and the rule keeps a draft
exactly when it is the main model's argmax: greedy decoding's tokens (tested).
"""

from __future__ import annotations

import torch

from moeflow.engine.sampling import GenerationConfig, penalize_repetitions, warp_scores


def sampler_probs(logits: torch.Tensor, gen: GenerationConfig, seen: torch.Tensor) -> torch.Tensor:
    """logits [1, V] and the sequence so far seen int64 [N] (host) -> the sampler's distribution fp32 [V]."""
    logits = logits.float()
    if gen.repetition_penalty != 1.0 and seen.numel():
        logits = penalize_repetitions(logits, seen.to(logits.device)[None], gen.repetition_penalty)
    return warp_scores(logits, gen).softmax(dim=-1)[0]


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs fp32 [V]."""
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator | None
                       ) -> tuple[bool, int]:
    """The rule for one draft ``token`` drawn from q fp32 [V] against the target's p fp32 [V]: (kept, the token
    output at this position: ``token`` when kept, else a draw from the residual max(0, p - q))."""
    u = float(torch.rand(1, generator=generator, device=p.device)[0])
    if u * float(q[token]) < float(p[token]):  # probability min(1, p/q)
        return True, token
    residual = (p - q).clamp_(min=0)
    total = float(residual.sum())
    return False, draw(residual / total if total > 0 else p, generator)
