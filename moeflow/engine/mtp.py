"""Speculative decoding with the model's own multi-token-prediction layers (``generate(num_speculative_tokens=k)``).

Each round drafts up to k tokens with the MTP layers (:mod:`moeflow.families.mtp`) and verifies them in one pass of
the main model over ``1 + k`` tokens, keeping a draft token only where it equals the main model's greedy token at its
position; the first disagreement contributes the main model's own token, and a fully accepted draft a bonus token.
So the output is plain greedy decoding's (as prompt lookup's, :mod:`moeflow.engine.lookup`, whose pass inputs and
token picking this reuses). Rejected drafts' keys lie beyond the kept length, in the main cache and in the MTP
layers' own cache, and are overwritten before any query position reaches them (the cache's mask is causal).

Positions. The main model's final-normed hidden state at position i and the token at i + 1 go into MTP layer 1 at
position i (its own cache), which predicts the token at i + 2; a chained draft feeds the layer's normed output and
the drafted token in at position i + 1, and so on (the first MTP layer again when the model has fewer layers than
the chain is long, as the serving engines chain DeepSeek-V3's single layer). After the prefill the MTP layer runs
over the prompt (every position's hidden state with the next token), after each verify pass over the kept
positions only.

Offloading. The MTP layers' experts are the expert backend's last MoE layers: every MTP pass and every verify pass
is a forward pass announced by ``begin_step``; the experts a verify pass needs for its 1 + k tokens are moved once.
``model.stats`` counts ``draft_tokens`` (proposed), ``accepted_tokens`` and ``generated_tokens``;
``stats.bytes_per_generated_token`` divides the bytes moved while decoding by the tokens decoded (the first round's
drafting, the MTP layer over the prompt, counts with the prefill, as the prefill of the MTP layer). With
``prefetch`` (``generate(mtp_prefetch=...)``) the verify pass's experts are predicted from its drafts and queued
before it runs (:mod:`moeflow.engine.mtp_prefetch`; ``stats.draft_prefetch`` counts them).

Linear-attention layers (Qwen3-Next, Qwen3.5-MoE). Their recurrent and conv states have no per-position entries to
leave behind: a verify pass advances them over all ``1 + k`` tokens. The states are copied before each verify pass
(``HybridKVCache.snapshot``); when a draft is rejected they are put back and the DeltaNet layers alone run again
over the inputs the verify pass gave them at the kept positions (:mod:`moeflow.engine.linear_rollback`: no second
pass of the model, no expert moved), so the next pass starts from the state after the kept tokens.

Sampling (``do_sample=True``): standard speculative sampling (:mod:`moeflow.engine.spec_sampling`): drafts drawn from
the MTP layer's distribution under the same sampler, each kept with probability min(1, p/q), the residual drawn at
the first rejection, so the output is distributed as plain sampling's (not the same draws for a seed).

Limits (refused by :func:`check_mtp`): one sequence, no micro-batches, eager passes (the captured and compiled
decode steps are not used for these passes: every pass runs the decoder eagerly).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moeflow.engine.generate import Runner, positions_from_mask
from moeflow.engine.kv_cache import PassCache
from moeflow.engine.latent_cache import new_kv_cache
from moeflow.engine.linear_rollback import LinearInputRecorder
from moeflow.engine.linear_state import HybridKVCache
from moeflow.engine.lookup import begin_speculation, count_pass, pass_inputs, pick
from moeflow.engine.mtp_prefetch import DraftPrefetcher
from moeflow.engine.sampling import GenerationConfig
from moeflow.engine.spec_sampling import accept_or_resample, draw, sampler_probs
from moeflow.families.base import Family
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.moe.backend import StepInfo
from moeflow.moe.block import RoutingRecorder
from moeflow.streaming import Streamer


def check_mtp(family: Family, mtp: MultiTokenPredictor | None, gen: GenerationConfig, batch: int, num_tokens: object,
              micro_batch_size: object, dual_batch: object, prompt_lookup: object) -> None:
    """Refuse, naming the argument or config field, what MTP speculation does not cover."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_tokens!r}")
    if mtp is None:
        field = family.mtp_config_field
        if field is None or family.num_mtp_layers() == 0:
            what = f"config.json has {field}={family.num_mtp_layers()}" if field else \
                f"the {family.name} family has no multi-token-prediction layers moeflow reads"
            hint = "" if family.kv_cache_spec().linear is not None else \
                "; prompt_lookup_num_tokens drafts without them"
            raise ValueError(f"num_speculative_tokens drafts with the model's multi-token-prediction layers, but "
                             f"{what}{hint}")
        raise ValueError(f"num_speculative_tokens: the model was loaded without its multi-token-prediction layers "
                         f"(config.json {field}={family.num_mtp_layers()}); load it with "
                         "from_pretrained(..., mtp=True)")
    if prompt_lookup is not None:
        raise ValueError("num_speculative_tokens and prompt_lookup_num_tokens are two ways to draft: pass one")
    if batch != 1:
        raise ValueError(f"num_speculative_tokens needs a batch of one sequence (got {batch})")
    if micro_batch_size is not None or dual_batch:
        raise ValueError("num_speculative_tokens does not combine with micro_batch_size / dual_batch")


class MTPDrafter:
    """The MTP layers' passes over their own cache (``layers[0]`` is the first MTP layer)."""

    def __init__(self, runner: Runner, mtp: MultiTokenPredictor, max_len: int) -> None:
        self.runner, self.mtp = runner, mtp
        spec = runner.kv_cache_spec() if runner.kv_cache_spec is not None else None
        if spec is None:
            raise ValueError("MTP speculation needs the family's KV cache spec")
        spec = type(spec)(len(mtp.layers), spec.kv_heads, spec.head_dim, spec.latent_dim, None)
        self.cache = new_kv_cache(spec, 1, max_len, runner.dtype, runner.device)
        self.states: list[torch.Tensor] = []  # this round's MTP outputs [H] of each run's last position

    def run(self, depth: int, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
            cache_position: torch.Tensor, token_mask: torch.Tensor, history: tuple
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``depth % layers`` over hidden [1, T, H] (the depth before's, normed) and the next tokens
        next_ids [1, T] at positions [1, T] / cache_position [T] -> (logits fp32 [1, V] of the last position, its
        normed output [1, 1, H] for the next depth). The backend sees a pass of the stats' current phase (the
        pass over the prompt is the MTP layer's prefill). The block's output at the last position [H] joins
        ``states`` (the draft-informed prefetch's proxy, :mod:`moeflow.engine.mtp_prefetch`)."""
        runner, layer = self.runner, self.mtp.layers[depth % len(self.mtp.layers)]
        embeds = runner.decoder.embed_tokens(next_ids)
        runner.backend.begin_step(StepInfo(next_ids, positions, token_mask, runner.stats.phase, None, embeds,
                                           history[0], history[1], all_real=bool(token_mask.all())))
        cos, sin = runner.decoder.rotary(positions, embeds.dtype)
        self.cache.mark_valid(cache_position, token_mask)
        mask = self.cache.attention_mask(cache_position, None)
        x = layer(hidden, embeds, positions, cos, sin, self.cache, cache_position, mask, runner.backend)
        self.states.append(x[0, -1])
        out = layer.shared_head(x[:, -1:])
        return runner.decoder.lm_head(out).float()[:, -1], out


def eager_pass(runner: Runner, ids: torch.Tensor, positions: torch.Tensor, cache: PassCache,
               cache_position: torch.Tensor, token_mask: torch.Tensor, phase: str, history: tuple, all_real: bool,
               routing: RoutingRecorder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass of the main decoder (eager) -> (logits fp32 [1, T, V], final-normed hidden [1, T, H]);
    ``routing``: where the MoE layers keep their top-k ids."""
    embeds = runner.decoder.embed_tokens(ids)
    runner.backend.begin_step(StepInfo(ids, positions, token_mask, phase, None, embeds, history[0], history[1],
                                       all_real=all_real))
    return runner.decoder(embeds, positions, cache, cache_position, token_mask, runner.backend, routing,
                          return_hidden=True)


def generate_with_mtp(runner: Runner, mtp: MultiTokenPredictor, gen: GenerationConfig, input_ids: torch.Tensor,
                      token_mask: torch.Tensor, num_tokens: int, streamer: Streamer | None = None,
                      seed: int | None = None, prefetch: str | None = None) -> torch.Tensor:
    """input_ids / token_mask [1, T] on the device -> [1, T + n] ids, drafting up to ``num_tokens`` tokens per
    round with the MTP layers and verifying them in one pass: greedy, or with ``gen.do_sample`` standard
    speculative sampling (:mod:`moeflow.engine.spec_sampling`; ``seed``: its generator's). ``prefetch``: the
    draft-informed prefetch's proxy (:mod:`moeflow.engine.mtp_prefetch`), None: none."""
    stats, device = runner.stats, runner.device
    start_state = begin_speculation(runner, gen, input_ids, token_mask, "num_speculative_tokens", streamer,
                                    reuse=False, linear_ok=True)
    if start_state is None:
        return input_ids
    t, total, eos, cache, seq, pad, hist, hist_mask = start_state
    drafter = MTPDrafter(runner, mtp, total)
    blocks = runner.decoder.moe_blocks
    prefetcher = DraftPrefetcher(blocks, runner.decoder.embed_tokens, runner.backend, prefetch) \
        if prefetch is not None else None
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sample = gen.do_sample

    def choose(logits: torch.Tensor, seen: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token from logits [1, V] after the sequence ``seen`` (host): (token, q [V] when sampling)."""
        if not sample:
            return pick(logits, gen, seen, device), None
        q = sampler_probs(logits, gen, seen)
        return draw(q, generator), q

    start = time.perf_counter()
    stats.set_phase("prefill")
    positions = positions_from_mask(token_mask)
    logits, hidden = eager_pass(runner, input_ids, positions, cache, torch.arange(t, device=device), token_mask,
                                "prefill", (input_ids, token_mask), all_real=pad == 0)
    count_pass(stats, int(token_mask.sum()), start)
    first = draw(sampler_probs(logits[:, -1], gen, seq[pad:t]), generator) if sample else \
        pick(logits[:, -1], gen, seq[pad:t], device)
    stats.ttft_s = time.perf_counter() - start
    stats.generated_tokens += 1
    # the MTP layer over the prompt: hidden at position i with the token at i + 1 (the last one: ``first``)
    new, n = [first], t
    mtp_ids = torch.cat((input_ids[:, 1:], torch.tensor([[first]], device=device)), dim=1)
    mtp_in = (hidden, mtp_ids, positions, torch.arange(t, device=device), token_mask)
    decode_start = time.perf_counter()
    stats.set_phase("decode")
    with LinearInputRecorder(runner.decoder) as recorder:  # (DeltaNet layers: see linear_rollback)
        while True:
            room = total - n - len(new)
            seq[n:n + len(new)] = torch.tensor(new)
            hist[0, n:n + len(new)] = seq[n:n + len(new)].to(device)
            n += len(new)
            if streamer is not None:
                streamer.put(torch.tensor([new]))
            if room == 0 or eos.intersection(new):
                break
            start = time.perf_counter()
            history = (hist[:, :n], hist_mask[:, :n])
            if n == t + 1:  # the first round's drafts: the MTP layer over the prompt, counted with the prefill
                stats.set_phase("prefill")
            drafter.states.clear()
            draft, qs = propose(drafter, mtp_in, min(num_tokens, room - 1), n, pad, history, device,
                                lambda logits, drafted, kept=seq[pad:n]: choose(logits, torch.cat((kept, torch.tensor(
                                    drafted, dtype=torch.long)))))
            stats.set_phase("decode")
            seq[n:n + len(draft)] = torch.tensor(draft, dtype=torch.long)
            ids, pos, cache_position, mask = pass_inputs(seq[n - 1:n + len(draft)], n - 1, 1 + len(draft), pad,
                                                         cache.max_len, True, device)
            restore = cache.snapshot() if isinstance(cache, HybridKVCache) else None
            recorder.active = restore is not None
            routing = None
            if prefetcher is not None:  # the verify pass's experts queued from its drafts
                prefetcher.prefetch(ids[0], drafter.states)
                routing = RoutingRecorder(len(blocks))
            logits, hidden = eager_pass(runner, ids, pos, cache, cache_position, mask, "decode", history, True,
                                        routing)
            if prefetcher is not None:
                prefetcher.count(stats.draft_prefetch, routing)
            recorder.active = False
            new = []
            for j in range(len(draft) + 1):
                if not sample:
                    tok = pick(logits[0, j:j + 1], gen, seq[pad:n + j], device)
                    kept = j < len(draft) and tok == draft[j]
                elif j < len(draft):
                    kept, tok = accept_or_resample(sampler_probs(logits[0, j:j + 1], gen, seq[pad:n + j]), qs[j],
                                                   draft[j], generator)
                else:
                    kept, tok = False, draw(sampler_probs(logits[0, j:j + 1], gen, seq[pad:n + j]), generator)
                new.append(tok)
                if not kept or tok in eos:
                    break
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += len(new) - 1
            stats.generated_tokens += len(new)
            count_pass(stats, 1 + len(draft), start)
            kept = len(new)  # positions n - 1 .. n + kept - 2 now hold kept tokens whose next token is known
            if restore is not None and kept < 1 + len(draft):  # the linear states advanced past the kept tokens
                restore()
                cache.mark_valid(cache_position[:kept], mask[:, :kept])  # (the pass mask the DeltaNet layers read)
                recorder.replay(cache, kept)
            mtp_in = (hidden[:, :kept], torch.tensor([new], device=device), pos[:, :kept], cache_position[:kept],
                      mask[:, :kept])
    produced = n - t
    if produced > 1:
        stats.tpot_s = (time.perf_counter() - decode_start) / (produced - 1)
    if device.type == "cuda":
        stats.peak_gpu_bytes = max(stats.peak_gpu_bytes, torch.cuda.max_memory_allocated(device))
    if streamer is not None:
        streamer.end()
    return hist[:, :n]


def propose(drafter: MTPDrafter, mtp_in: tuple, k: int, n: int, pad: int, history: tuple, device: torch.device,
            choose: Callable[[torch.Tensor, list[int]], tuple[int, torch.Tensor | None]]
            ) -> tuple[list[int], list[torch.Tensor | None]]:
    """Up to ``k`` draft tokens and their draft distributions (None when greedy): the first MTP layer over
    ``mtp_in`` (hidden, next ids, positions, cache positions, mask of the positions whose next token became
    known), then chained one token at a time. ``n``: tokens kept so far (the first draft is the token at position
    n); ``choose(logits [1, V], drafts so far)``: the token and its q."""
    if k == 0:
        return [], []
    hidden, ids, positions, cache_position, mask = mtp_in
    logits, out = drafter.run(0, hidden, ids, positions, cache_position, mask, history)
    tok, q = choose(logits, [])
    draft, qs = [tok], [q]
    for depth in range(1, k):
        cp = n - 2 + depth  # the chained input: the last draft (position cp + 1), at the position after the last run
        ids = torch.tensor([[draft[-1]]], device=device)
        one = torch.ones((1, 1), dtype=torch.bool, device=device)
        logits, out = drafter.run(depth, out, ids, torch.tensor([[cp - pad]], device=device),
                                  torch.tensor([cp], device=device), one, history)
        tok, q = choose(logits, draft)
        draft.append(tok)
        qs.append(q)
    return draft, qs
